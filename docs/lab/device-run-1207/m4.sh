#!/usr/bin/env bash
# Ran at commit 1782d65: `--stages`, the `stages3` spec and the st3 plans were reverted after it.
# Fourth run of the 2026-12-07 lease: the page-key kernel's copy pipeline three tiles deep
# (KernelChoices.page_key_stages = 3, dynamic shared memory), after m3's phase probe timed the
# kernel with its compute cut out at 87 % of its time. Checked on the GPU against the reference
# (5 cases) and bitwise against two stages (the layer profile's max abs diff), then timed:
# bench.kv's paired decode rows, the kernel alone, the 8B step, the probe at three stages.
RUN=m4; source docs/lab/device-run-1205c/lib.sh
timeout 120 python3 -m bench.cuda_emulate_page_keys --stages 3 --device > "$D/check3.txt" 2>&1
echo "== check3 rc=$?" | tee -a "$D/steps.txt" >&2
step kv-st3 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 \
  --decode-formats k6v4-kivi,k6v4-kivi:stages3,k6v4-kivi:stages3+split-512
timeout 120 python3 -m bench.device.page_key_layer_profile \
  --rows gpu:32768:8,gpu:4096:1,llama8b-2l:4096:8 --parts kernel --budget-s 100 \
  --out "$D/layer-profile.json" > "$D/layer-profile.log" 2>&1
echo "== layer-profile rc=$?" | tee -a "$D/steps.txt" >&2
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b 120 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8,k6v4-kivi:stages3@8 --untraced 3 --top 6
step phases3 90 python3 -m bench.device.page_key_phase_probe --rows gpu:32768:8 --stages 3
