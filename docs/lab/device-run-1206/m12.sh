#!/usr/bin/env bash
# Second run of the 2026-12-06 lease (right after m10.sh, same machine), m11.sh cut to what the
# bars need when the session's device time is short: the 8B step at batch 8 after 4K keys per
# kernel (CUPTI, and untraced), then prefill with the chunk write kernel against the MLX write.
RUN=m12; source docs/lab/device-run-1205c/lib.sh
step kt-8b 220 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8 --untraced 3 --top 15
step kv-prefill 150 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --chunk 2048 --prefill-formats k6v4-kivi:chunk-write,k6v4-kivi:mlx-write --repeats 2
