#!/usr/bin/env bash
# Second run of the lease: prefill with the chunk write kernel against the MLX write; the 8B
# step at batch 8 after 4K keys, native against k6v4-kivi with the write kernel (tails in place)
# and with the decode kernel storing its rows (CUPTI per kernel, untraced rates); the 16K
# prefill trace with the chunk write kernel if time is left.
RUN=m8; source docs/lab/device-run-1205c/lib.sh   # shared with the afternoon lease
step kv-prefill 150 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --chunk 2048 --prefill-formats k6v4-kivi:chunk-write,k6v4-kivi:mlx-write --repeats 2
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.2-1b llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b 260 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8,k6v4-kivi:own-write@8 --untraced 3 --top 15
step kt-prefill 110 python3 -m bench.device.kernel_trace --model $W/llama-3.2-1b-random \
  --variants prefill:native@16384,prefill:k6v4-kivi:chunk-write@16384 --untraced 2 --top 12
