#!/usr/bin/env bash
# First lease of 2026-12-05 (night): page-key tails written in place by the CUDA write kernel
# (TailMap hands a given-back slot to a new page only in a later step while another is free).
# Byte equality of chunk writes with the MLX write on the GPU (both tail modes), the decode bars
# against the tiled native kernel, prefill with the chunk write against the MLX write, and the
# prefill trace.
RUN=m7; source docs/lab/device-run-1205d/lib.sh
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" llama-3.2-1b \
  > "$D/shapes.log" 2>&1
step compare 60 python3 -m bench.page_key_chunk_compare
step kv-decode 170 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --decode-formats k6v4-kivi --interleave --pipelined --repeats 3 --steps 16
step kv-prefill 150 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --chunk 2048 --prefill-formats k6v4-kivi:chunk-write,k6v4-kivi:mlx-write --repeats 2
step kt-prefill 110 python3 -m bench.device.kernel_trace --model $W/llama-3.2-1b-random \
  --variants prefill:native@16384,prefill:k6v4-kivi:chunk-write@16384 --untraced 2 --top 12
