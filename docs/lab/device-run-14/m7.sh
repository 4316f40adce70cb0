#!/usr/bin/env bash
# Ran at commit eea1674 (the kernel as it went on by default in eb6a18d), on an H100 (an
# H200 was asked for each run, none lent).
# Seventh run of device run 14 (2026-12-06): the warp-page kernel (default shape 4x2, key metadata
# in sector-sized pairs since m5) against the block-tiled kernel in the step: bench.kv's paired
# rows and kernel_trace at 32K batch 8 and the 8B shape at 4K batch 8, to decide its default.
RUN=m7; source docs/lab/device-run-1205c/lib.sh
step kv 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 \
  --decode-formats k6v4-kivi,k6v4-kivi:warp-pages
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b 150 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8,k6v4-kivi:warp-pages@8 --untraced 3 --top 6
step kt-32k 120 python3 -m bench.device.kernel_trace --geometry gpu --context 32768 \
  --variants native@8,k6v4-kivi@8,k6v4-kivi:warp-pages@8 --untraced 3 --top 8 --steps 16
