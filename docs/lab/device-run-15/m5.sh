#!/usr/bin/env bash
# Ran at commit a45028b, on an H100 (an H200 was asked for; none lent).
# Fifth run of device run 15 (H100, inline, warm machine): bench.kv's paired rows at pages of 64,
# 7 rounds each, both page-key kernels against native.
RUN=m5; source docs/lab/device-run-1205c/lib.sh; BUDGET=150
step kv64-32k 140 python3 -m bench.kv --geometry gpu --sections decode --decode 32768,4096 \
  --batches 8,1 --interleave --pipelined --repeats 7 --steps 16 --page-tokens 64 \
  --decode-formats k6v4-kivi:block-tiled,k6v4-kivi:warp-pages
