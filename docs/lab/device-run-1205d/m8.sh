#!/usr/bin/env bash
# Second run of the lease: the 8B step at batch 8 after 4K keys, native against k6v4-kivi
# (CUPTI per kernel, untraced rates), with the page-key tails written in place.
RUN=m8; source docs/lab/device-run-1205d/lib.sh
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" llama-3.1-8b \
  > "$D/shapes.log" 2>&1
step kt-8b 200 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8 --untraced 3 --top 15
