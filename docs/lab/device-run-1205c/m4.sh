#!/usr/bin/env bash
# Second lease: float32 scores in the ops prefill path (engine/attention/ops_prefill.py). Greedy
# agreement on real SmolLM2 again (native with the new ops path, native with prompts through
# cuDNN as mlx-lm's, int8), the quality gate's quick NLL/KL on the GPU, and what float32
# scores cost per prefill call (bench.prefill_scores).
RUN=m4; source docs/lab/device-run-1205c/lib.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$D/gpu.txt"
M=$(bash bench/device/real_smollm2.sh) || exit 1
step scores 90 python3 -m bench.prefill_scores
step greedy 240 python3 -m bench.greedy_agreement --model "$M" \
  --formats native,native+prefill_attention=fast,int8
step gate 180 env MLX_ENABLE_TF32=0 python3 -m quality.gate --model "$M" --quick \
  --formats native,int8,k8v4,k6v4-kivi
