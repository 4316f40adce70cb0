#!/usr/bin/env bash
# Ran at commit 973c4a6: its `mbN` spec and the merge rewrite were reverted after this run.
# Second run of the 2026-12-07 lease. m1 found the page-key kernel at 128 registers a thread
# (ptxas), so 4 blocks of 128 threads an SM (528 on 132 SMs) while the 32K batch-8 plan launches
# 544 (17 splits x 32): 16 blocks in a second wave; and the split merge at 19 us a call (both
# kernels). Here: the merge rewritten (two memory rounds, not 2 x NS dependent loads), the
# kernel's split plans and launch bound (KernelChoices.page_key_min_blocks: 96 registers, 5
# blocks an SM) at the kernel alone (with each variant's max abs diff to the default) and in
# bench.kv's paired decode rows, then the gpu 32K step traced again.
RUN=m2; source docs/lab/device-run-1205c/lib.sh
timeout 120 python3 -m bench.device.page_key_layer_profile --rows gpu:32768:8,gpu:4096:8 \
  --parts kernel --budget-s 100 --out "$D/layer-profile.json" > "$D/layer-profile.log" 2>&1
echo "== layer-profile rc=$?" | tee -a "$D/steps.txt" >&2
F=k6v4-kivi,k6v4-kivi:split-512,k6v4-kivi:mb5,k6v4-kivi:mb5+split-640,k6v4-kivi:mb5+mma
step kv-32k 200 python3 -m bench.kv --geometry gpu --sections decode --decode 32768 \
  --batches 8 --interleave --pipelined --repeats 3 --steps 16 --decode-formats $F
step kv-4k 100 python3 -m bench.kv --geometry gpu --sections decode --decode 4096 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 \
  --decode-formats k6v4-kivi,k6v4-kivi:mb5
step kt-gpu-32k 90 python3 -m bench.device.kernel_trace --geometry gpu \
  --context 32768 --variants native@8,k6v4-kivi@8,k6v4-kivi:mb5@8 --untraced 3 --top 8 --steps 16
