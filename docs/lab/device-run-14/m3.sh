#!/usr/bin/env bash
# Ran at commit 904c18e (as m2), on an H100 (an H200 was asked for each run, none lent).
# Third run of device run 14 (2026-12-06): the Llama-3.1-8B shape (random weights) at batch 8 after
# 4K keys, native against k6v4-kivi through the block-tiled and the warp-page kernels.
RUN=m3; source docs/lab/device-run-1205c/lib.sh
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b 200 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8,k6v4-kivi:warp-pages@8 --untraced 3 --top 6
step kt-32k 200 python3 -m bench.device.kernel_trace --geometry gpu --context 32768 \
  --variants native@8,k6v4-kivi@8,k6v4-kivi:warp-pages@8 --untraced 3 --top 8 --steps 16
