#!/usr/bin/env bash
# Second run of the lease (right after m10.sh, same machine): the 8B step at batch 8 after 4K
# keys per kernel (CUPTI; device run 10 had the page-key kernel at 86.8 us a layer, tiled native
# 70.2), then prefill with the chunk write kernel against the MLX write (never measured yet:
# `page_key_chunk_write` stays off until it is) and its 16K trace.
RUN=m11; source docs/lab/device-run-1205c/lib.sh
step kt-8b 220 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8 --untraced 3 --top 15
step kv-prefill 150 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --chunk 2048 --prefill-formats k6v4-kivi:chunk-write,k6v4-kivi:mlx-write --repeats 2
step kt-prefill 110 python3 -m bench.device.kernel_trace --model $W/llama-3.2-1b-random \
  --variants prefill:native@16384,prefill:k6v4-kivi:chunk-write@16384 --untraced 2 --top 12
