#!/usr/bin/env bash
# Ran at commit 697f2bd, on an H100 (an H200 was asked for; none lent).
# Second run of device run 16 (inline, warm machine): prefill at pages of 64 (bar: <= 1.3x
# native's time at 4K and 16K), the Llama-3.1-8B shape at 4K batch 8 (bar: >= 1.0x), and the
# 32K batch-8 device time (CUPTI) at pages of 64, each against native on the same card.
RUN=m2; source docs/lab/device-run-1205c/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader > "$D/gpu.txt" 2>&1
step pf64 120 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --prefill-formats k6v4-kivi --repeats 3 --page-tokens 64
step kt-32k-64 130 python3 -m bench.device.kernel_trace --geometry gpu --context 32768 \
  --page-tokens 64 --variants native@8,k6v4-kivi@8 --untraced 5 --top 6 --steps 32
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b-64 200 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --page-tokens 64 --variants native@8,k6v4-kivi@8 --untraced 5 --top 6
