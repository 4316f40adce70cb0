#!/usr/bin/env bash
# Fifth run of device run 16: the page-key kernels' split floor is now 64 keys
# (page_key_decode.MIN_KEYS; m4 timed it as `split-528-64`). The batch-1 device time at pages
# of 64 and 16 against the old floor (`split-528-256`) and native; the Llama-3.1-8B shape at
# batch 1 (the floor sets its plan too) and batch 8 (unchanged plan); then bench.kv's paired
# rows at pages of 64.
RUN=m5; source docs/lab/device-run-1205c/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader > "$D/gpu.txt" 2>&1
step kt-4k-b1 130 python3 -m bench.device.kernel_trace --geometry gpu --context 4096 \
  --page-tokens 64 --variants native@1,k6v4-kivi@1,k6v4-kivi:split-528-256@1 --untraced 3 \
  --top 4 --steps 64
step kt-4k-b1-16 100 python3 -m bench.device.kernel_trace --geometry gpu --context 4096 \
  --page-tokens 16 --variants native@1,k6v4-kivi@1,k6v4-kivi:split-528-256@1 --untraced 3 \
  --top 4 --steps 64
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > /dev/null 2>&1
step kt-8b 170 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --page-tokens 64 --variants native@1,k6v4-kivi@1,native@8,k6v4-kivi@8 \
  --untraced 3 --top 4 --steps 32
step kv64 150 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 9 --steps 64 --page-tokens 64 \
  --decode-formats k6v4-kivi
