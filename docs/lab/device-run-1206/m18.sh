#!/usr/bin/env bash
# Last run of the 2026-12-06 lease: where a step's device time goes at 32K keys, batch 8 (the
# bar the page-key formats still miss), the 8B shape, native against k6v4-kivi (CUPTI).
RUN=m18; source docs/lab/device-run-1205c/lib.sh
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b-32k 130 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 32768 --variants native@8,k6v4-kivi@8 --untraced 2 --top 8 --steps 10
