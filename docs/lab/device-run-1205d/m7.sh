#!/usr/bin/env bash
# First lease of 2026-12-05 (night): page-key tails written in place by the CUDA write kernel
# (TailMap hands a given-back slot to a new page only in a later step while another is free),
# decode rows made contiguous once, and the decode kernel storing its own rows (`:own-write`).
# Byte equality on the GPU (chunk writes in both tail modes; compiled decode steps through the
# write kernel and the OWN decode kernel against the MLX write), the decode bars against the
# tiled native kernel with and without `:own-write`, and prefill with the chunk write kernel
# against the MLX write (what was left of the device budget: one run).
RUN=m7; source docs/lab/device-run-1205c/lib.sh   # shared with the afternoon lease
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" llama-3.2-1b \
  > "$D/shapes.log" 2>&1
step compare 50 python3 -m bench.page_key_chunk_compare
step stepcheck 90 python3 -m bench.page_key_step_check --model $W/llama-3.2-1b-random
step kv-decode 190 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --decode-formats k6v4-kivi,k6v4-kivi:own-write --interleave --pipelined \
  --repeats 2 --steps 16
step kv-prefill 130 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --chunk 2048 --prefill-formats k6v4-kivi:chunk-write,k6v4-kivi:mlx-write --repeats 1
