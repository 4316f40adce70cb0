#!/usr/bin/env bash
# Ran at commit 697f2bd, on an H100 (an H200 was asked for; none lent).
# First run of device run 16 (2026-12-06; asked for an H200): why k6v4-kivi's 4K batch-1 decode
# reads 0.88-0.95x native at pages of 64 (device run 15). Batch-1 steps are host-bound (the
# pipelined step waits ~0.01 ms on the device), so: the host's time a step per function for
# native and both page-key kernels (cProfile, bench.kv_decode_profile), at pages of 64 and 16;
# the device's busy and idle time a step at batch 1 (CUPTI); then bench.kv's paired rows at 64
# with 64 steps a round (16 before: a batch-1 round was ~15 ms, within one host stall).
RUN=m1; source docs/lab/device-run-1205c/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader > "$D/gpu.txt" 2>&1
step prof64 100 python3 -m bench.kv_decode_profile --geometry gpu --context 4096 --batch 1 \
  --page-tokens 64 --formats k6v4-kivi,k6v4-kivi:block-tiled --steps 64 --rounds 5 --top 30
step prof16 80 python3 -m bench.kv_decode_profile --geometry gpu --context 4096 --batch 1 \
  --page-tokens 16 --formats k6v4-kivi --steps 64 --rounds 5 --top 30
step kt-4k-b1 120 python3 -m bench.device.kernel_trace --geometry gpu --context 4096 \
  --page-tokens 64 --variants native@1,k6v4-kivi@1 --untraced 3 --top 8 --steps 64
step kv64 240 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 7 --steps 64 --page-tokens 64 \
  --decode-formats k6v4-kivi
