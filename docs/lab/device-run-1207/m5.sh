#!/usr/bin/env bash
# Ran at commit 53d7ae8: `:wide-copies` and `--wide-copies` are now the default (the old path:
# `:narrow-copies`, `--narrow-copies`).
# Fifth run of the 2026-12-07 lease: the page-key kernel's 6-bit key codes copied in 16-byte
# pieces through L2 (KernelChoices.page_key_wide_copies), after m4 found a deeper pipeline (less
# L1 beside 56 KB of shared memory) slower: checked on the GPU against the reference and
# bitwise against the 8-byte copies (the layer profile), then timed in bench.kv's paired rows,
# the kernel alone and the 8B step.
RUN=m5; source docs/lab/device-run-1205c/lib.sh
timeout 120 python3 -m bench.cuda_emulate_page_keys --wide-copies --device > "$D/check.txt" 2>&1
echo "== check rc=$?" | tee -a "$D/steps.txt" >&2
step kv-wide 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 \
  --decode-formats k6v4-kivi,k6v4-kivi:wide-copies,k6v4-kivi:wide-copies+split-512
timeout 120 python3 -m bench.device.page_key_layer_profile \
  --rows gpu:32768:8,gpu:4096:1,llama8b-2l:4096:8 --parts kernel --budget-s 100 \
  --out "$D/layer-profile.json" > "$D/layer-profile.log" 2>&1
echo "== layer-profile rc=$?" | tee -a "$D/steps.txt" >&2
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b 120 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8,k6v4-kivi:wide-copies@8 --untraced 3 --top 6
