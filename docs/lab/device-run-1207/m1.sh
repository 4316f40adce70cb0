#!/usr/bin/env bash
# First run of the next lease (staging first: bench/device/stage-mlx, 5 runs): where the
# 32K-batch-8 step's device time goes, the row whose bar (>= 1.3x native) the page-key formats
# still miss at 1.12-1.14x (device run 12, docs/lab/benchmarks-kv-page-keys.md): bench.kv's gpu
# row under CUPTI (its model: the gpu geometry), native against k6v4-kivi; the page-key kernel
# alone against native's at 32K batch 8 per split plan; then the 8B step at 32K batch 8.
RUN=m1; source docs/lab/device-run-1205c/lib.sh
step kt-gpu-32k 150 python3 -m bench.device.kernel_trace --geometry gpu \
  --context 32768 --variants native@8,k6v4-kivi@8 --untraced 3 --top 14 --steps 16
timeout 150 python3 -m bench.device.page_key_layer_profile --rows gpu:32768:8 \
  --parts kernel --budget-s 130 --out "$D/layer-profile.json" > "$D/layer-profile.log" 2>&1
echo "== layer-profile rc=$?" | tee -a "$D/steps.txt" >&2
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b-32k 150 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 32768 --variants native@8,k6v4-kivi@8 --untraced 2 --top 10 --steps 10
