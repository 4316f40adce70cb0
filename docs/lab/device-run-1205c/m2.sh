#!/usr/bin/env bash
# Issue 33's engine table with the tiled native kernel the default: bench.engine (engine and
# mlx-lm in one process) at the 1B and 8B shapes, batch 1 / 8 / 32 decode and prefill.
# PROC=1|2 names the process (two per shape).
RUN=m2-${PROC:-1}; source docs/lab/device-run-1205c/lib.sh
E="python3 -m bench.engine --decode-prompt 512 --decode-tokens 64 --warmup 1 --no-openblas-check"
step engine-1b 200 $E --model $W/llama-3.2-1b-random --prefill 2048,8192 \
  --batches 1,8,32 --repeats 3
step engine-8b 330 $E --model $W/llama-3.1-8b-random --prefill 2048 \
  --batches 1,8,32 --repeats 3
