#!/usr/bin/env bash
# Ran at commit 22810ce, on an H100 (an H200 was asked for; none lent).
# Third run of device run 16 (a fresh lease): the page-key kernels' native-key pass rewritten
# (tile_helpers._NATIVE_KEY_SCORES: 4 keys a warp loaded at once; the warp-page kernel's
# numerators a thread a channel over 8 keys at a time, its softmax a warp a head). m1 found the
# warp-page kernel at 44.7 us a layer against native's 35.2 at 4K batch 1, pages of 64: the
# split holding a row's partial page (up to 63 native keys) waited one load a key. First the
# kernels' outputs on the GPU against the reference, then the batch-1 device time at pages of
# 64 and 16, then bench.kv's paired rows at 64 and the 32K batch-8 trace.
RUN=m3; source docs/lab/device-run-1205c/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader > "$D/gpu.txt" 2>&1
timeout 150 python3 -m bench.cuda_emulate_page_keys --warp-pages --limit 8 --device \
  > "$D/check.txt" 2>&1
echo "== check rc=$?" | tee -a "$D/steps.txt" >&2
step kt-4k-b1-64 120 python3 -m bench.device.kernel_trace --geometry gpu --context 4096 \
  --page-tokens 64 --variants native@1,k6v4-kivi@1,k6v4-kivi:block-tiled@1 --untraced 5 \
  --top 8 --steps 64
step kt-4k-b1-16 90 python3 -m bench.device.kernel_trace --geometry gpu --context 4096 \
  --page-tokens 16 --variants native@1,k6v4-kivi@1 --untraced 5 --top 6 --steps 64
step kv64 150 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 7 --steps 64 --page-tokens 64 \
  --decode-formats k6v4-kivi
step kt-32k-64 100 python3 -m bench.device.kernel_trace --geometry gpu --context 32768 \
  --page-tokens 64 --variants native@8,k6v4-kivi@8 --untraced 5 --top 6 --steps 32
# (kv64's JSON did not come back: a run returns at most 8 files. Rerun inline on the same warm
# machine as kv64b: `--repeats 9`, otherwise the same command, with --out $OUT/m3/kv64b.json.)
