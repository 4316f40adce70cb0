#!/usr/bin/env bash
# Ran at commit a45028b, on an H100 (an H200 was asked for; none lent).
# Third run of device run 15 (H100, run inline on the warm machine right after m2): bench.kv at
# pages of 64 again with 5 rounds and the 2x3 warp shape, and kernel_trace's 32K batch-8 step
# at 64 for native and the warp-page kernel.
RUN=m3; source docs/lab/device-run-1205c/lib.sh; BUDGET=300
step kv64r 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 5 --steps 16 --page-tokens 64 \
  --decode-formats k6v4-kivi:block-tiled,k6v4-kivi:warp-pages,k6v4-kivi:warp-pages-2x3
step kt-32k-64 120 python3 -m bench.device.kernel_trace --geometry gpu --context 32768 \
  --page-tokens 64 --variants native@8,k6v4-kivi:warp-pages@8 --untraced 3 --top 8 --steps 16
