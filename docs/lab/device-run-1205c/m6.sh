#!/usr/bin/env bash
# Fourth lease: page-key prefill chunks written by the CUDA write kernel (PageKeyStore
# chunk_writer). Byte equality with the MLX write on the GPU, then prefill time against native
# with and without it (bench.kv's `:chunk-write` and `:mlx-write`), and CUPTI traces.
RUN=m6; source docs/lab/device-run-1205c/lib.sh
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" llama-3.2-1b \
  > "$D/shapes.log" 2>&1
step compare 60 python3 -m bench.page_key_chunk_compare
step kv-prefill 150 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 \
  --chunk 2048 --prefill-formats k6v4-kivi:chunk-write,k6v4-kivi:mlx-write --repeats 2
step kt-prefill 110 python3 -m bench.device.kernel_trace --model $W/llama-3.2-1b-random \
  --variants prefill:native@16384,prefill:k6v4-kivi:chunk-write@16384,\
prefill:k6v4-kivi:mlx-write@16384 --untraced 2 --top 12
