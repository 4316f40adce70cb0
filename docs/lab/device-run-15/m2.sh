#!/usr/bin/env bash
# Ran at commit a45028b, on an H100 (an H200 was asked for; none lent).
# Second run of device run 15: prefill at pages of 64 (the bar: <= 1.3x native's time
# at 4K and 16K), where the time goes at 32K batch 8 at pages of 64 (CUPTI, per step: native
# against both page-key kernels), and the decode rows at pages of 16 for the same machine.
RUN=m2; source docs/lab/device-run-1205c/lib.sh
step pf64 120 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --prefill-formats k6v4-kivi --repeats 3 --page-tokens 64
step kt-32k-64 150 python3 -m bench.device.kernel_trace --geometry gpu --context 32768 \
  --page-tokens 64 --variants native@8,k6v4-kivi:block-tiled@8,k6v4-kivi:warp-pages@8 \
  --untraced 3 --top 8 --steps 16
step kv16 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 --page-tokens 16 \
  --decode-formats k6v4-kivi
