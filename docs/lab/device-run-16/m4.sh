#!/usr/bin/env bash
# Ran at commit 53cd96a, on an H100 (an H200 was asked for; none lent).
# Fourth run of device run 16 (a fresh lease): m3 found the native-key pass was not what held
# the warp-page kernel at batch 1 (32.7 against native's 25.7 us a layer at 4K, pages of 64: the
# same ratio as m1's 44.7 / 35.2). At batch 1 the split plan gives 16 splits of 256 keys a KV
# head (64 blocks on 132 SMs), so each block's serial pipeline is the kernel's time: shorter
# splits for the page-key kernel only (bench.kv's split-T-K spec), and the warp-page kernel
# with one warp a block, against native and the default, device time (CUPTI) then paired rows.
RUN=m4; source docs/lab/device-run-1205c/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader > "$D/gpu.txt" 2>&1
V="k6v4-kivi,k6v4-kivi:split-528-128,k6v4-kivi:split-528-64"
V="$V,k6v4-kivi:warp-pages-1x4+split-2112-64,native:tiled-64"
step kt-4k-b1 150 python3 -m bench.device.kernel_trace --geometry gpu --context 4096 \
  --page-tokens 64 --variants "$(echo "native,$V" | sed 's/,/@1,/g')@1" --untraced 3 --top 4 \
  --steps 64
step kv-b1 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1 --interleave --pipelined --repeats 7 --steps 64 --page-tokens 64 \
  --decode-formats "$V"
step kv-b8 150 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 8 --interleave --pipelined --repeats 5 --steps 64 --page-tokens 64 \
  --decode-formats "k6v4-kivi,k6v4-kivi:split-528-128,k6v4-kivi:split-528-64"
