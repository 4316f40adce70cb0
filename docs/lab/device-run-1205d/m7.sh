#!/usr/bin/env bash
# First lease of 2026-12-05 (night): page-key tails written in place by the CUDA write kernel
# (TailMap hands a given-back slot to a new page only in a later step while another is free),
# decode rows made contiguous once, and the decode kernel storing its own rows (`:own-write`).
# Byte equality of chunk writes with the MLX write on the GPU (both tail modes), the decode bars
# against the tiled native kernel, and prefill with the chunk write against the MLX write.
RUN=m7; source docs/lab/device-run-1205d/lib.sh
step compare 60 python3 -m bench.page_key_chunk_compare
step kv-decode 250 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --decode-formats k6v4-kivi,k6v4-kivi:own-write --interleave --pipelined \
  --repeats 3 --steps 16
step kv-prefill 150 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --chunk 2048 --prefill-formats k6v4-kivi:chunk-write,k6v4-kivi:mlx-write --repeats 2
