#!/usr/bin/env bash
# Fourth run of the 2026-12-06 lease (right after m15.sh): the page-key split plan below 528
# blocks a layer, and the 8B step at 528 and 264.
RUN=m16; source docs/lab/device-run-1205c/lib.sh
step kv-split 100 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 8 --interleave --pipelined --repeats 3 --steps 16 \
  --decode-formats k6v4-kivi:split-528,k6v4-kivi:split-264,k6v4-kivi:split-132
step kt-8b-split 90 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi:split-528@8,k6v4-kivi:split-264@8 --untraced 3 \
  --top 6
