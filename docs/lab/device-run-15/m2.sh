#!/usr/bin/env bash
# Second run of device run 15: where the time goes at pages of 64 (CUPTI, per step), native
# against both page-key kernels, at 32K batch 8 (bench.kv's gpu geometry) and the Llama-3.1-8B
# shape at 4K batch 8; the 8B shape's rows at 16 for the same run; prefill at pages of 64.
RUN=m2; source docs/lab/device-run-1205c/lib.sh
step kt-32k-64 150 python3 -m bench.device.kernel_trace --geometry gpu --context 32768 \
  --page-tokens 64 --variants native@8,k6v4-kivi:block-tiled@8,k6v4-kivi:warp-pages@8 \
  --untraced 3 --top 8 --steps 16
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b-64 170 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --page-tokens 64 \
  --variants native@8,k6v4-kivi:block-tiled@8,k6v4-kivi:warp-pages@8 --untraced 3 --top 6
step kt-8b-16 150 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --page-tokens 16 --variants native@8,k6v4-kivi@8 --untraced 3 --top 6
step pf64 120 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --prefill-formats k6v4-kivi --repeats 3 --page-tokens 64
