#!/usr/bin/env bash
# NOT RUN in device run 16: the session's device time ran out on refused starts. The next lease's
# first command (after bench/device/stage-mlx's staging runs).
# Fifth run of device run 16: the page-key kernels' split floor is now 64 keys
# (page_key_decode.MIN_KEYS; m4 timed it as `split-528-64`). The batch-1 device time at pages
# of 64 and 16 against the old floor (`split-528-256`) and native, and the Llama-3.1-8B shape at
# batch 1, whose plan the floor sets too (CUPTI); then bench.kv's batch-1 rows at pages of 64.
RUN=m5; source docs/lab/device-run-1205c/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader > "$D/gpu.txt" 2>&1
step kt-4k-b1 100 python3 -m bench.device.kernel_trace --geometry gpu --context 4096 \
  --page-tokens 64 --variants native@1,k6v4-kivi@1,k6v4-kivi:split-528-256@1 --untraced 3 \
  --top 4 --steps 64
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > /dev/null 2>&1
step kt-8b 120 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --page-tokens 64 --variants native@1,k6v4-kivi@1,k6v4-kivi:split-528-256@1 \
  --untraced 3 --top 4 --steps 32
step kt-4k-b1-16 80 python3 -m bench.device.kernel_trace --geometry gpu --context 4096 \
  --page-tokens 16 --variants native@1,k6v4-kivi@1,k6v4-kivi:split-528-256@1 --untraced 3 \
  --top 4 --steps 64
