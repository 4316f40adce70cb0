#!/usr/bin/env bash
# Issue 32 against the tiled native kernel (now the default): k6v4-kivi's decode bars at the
# 0.5B geometry, its prefill bar at 4K / 16K, and CUPTI traces of a 16K prefill (native
# against the page-key dequant path) and of the 8B batch-8 decode step.
RUN=m3; source docs/lab/device-run-1205c/lib.sh
step kv-decode 170 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --decode-formats k6v4-kivi --interleave --pipelined --repeats 3 --steps 16
step kv-prefill 150 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --chunk 2048 --prefill-formats k6v4-kivi:kernel --repeats 3
step kt-prefill 120 python3 -m bench.device.kernel_trace --model $W/llama-3.2-1b-random \
  --variants prefill:native@16384,prefill:k6v4-kivi:kernel@16384 --untraced 2 --top 15
step kt-8b 120 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8 --untraced 2 --top 15
