#!/usr/bin/env bash
# First run of the next lease (staging first: bench/device/stage-mlx, 5 runs): where the
# 32K-batch-8 step's device time goes, the row whose bar (>= 1.3x native) the page-key formats
# still miss at 1.12-1.14x (device run 12, docs/lab/benchmarks-kv-page-keys.md): the 8B step
# under CUPTI, native against k6v4-kivi, then the page-key kernel alone against native's at
# 32K batch 8 per split plan (its `kernel` part: the default plan and the best it finds).
RUN=m1; source docs/lab/device-run-1205c/lib.sh
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b-32k 150 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 32768 --variants native@8,k6v4-kivi@8 --untraced 2 --top 10 --steps 10
timeout 200 python3 -m bench.device.page_key_layer_profile --rows gpu:32768:8,llama8b-2l:4096:8 \
  --parts kernel --budget-s 180 --out "$D/layer-profile.json" > "$D/layer-profile.log" 2>&1
echo "== layer-profile rc=$?" | tee -a "$D/steps.txt" >&2
