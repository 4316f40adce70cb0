#!/usr/bin/env bash
# Ran at commit a45028b, on an H100 (an H200 was asked for; none lent).
# Fourth run of device run 15 (H100, inline, warm machine): the Llama-3.1-8B shape at 4K batch 8
# at pages of 64 again (m1 had the warp-page kernel slower there than the block-tiled one), with
# the 2x3 warp shape.
RUN=m4; source docs/lab/device-run-1205c/lib.sh; BUDGET=200
[ -d "$W/llama-3.1-8b-random" ] || python3 -m bench.device.shaped_models \
  --tokenizer-from .device/mlx/p5/tok --out "$W" llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b-64 170 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --page-tokens 64 --untraced 3 --top 6 \
  --variants native@8,k6v4-kivi:block-tiled@8,k6v4-kivi:warp-pages@8,k6v4-kivi:warp-pages-2x3@8
