#!/usr/bin/env bash
# Run 1 after staging (the install run): real SmolLM2 in bf16 and the greedy agreement with
# mlx-lm, its noise floor (mlx-lm fused against mlx-lm plain) beside native and int8 (issue 33,
# item 4); then the 1B and 8B random-weight shapes for the later runs.
RUN=m1; source docs/lab/device-run-1205c/lib.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$D/gpu.txt"
M=$(bash bench/device/real_smollm2.sh) || exit 1
step greedy 240 python3 -m bench.greedy_agreement --model "$M" --formats native,int8 --noise-floor
t0=$(date +%s)
timeout 240 python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.2-1b llama-3.1-8b > "$D/shapes.log" 2>&1
echo "== shapes rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$D/steps.txt" >&2
