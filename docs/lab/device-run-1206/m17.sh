#!/usr/bin/env bash
# Fifth run of the 2026-12-06 lease: the page-key kernel's tensor-core score pass
# (KernelChoices.page_key_mma) checked on the GPU against the dequantized reference (the
# emulator's cases, the real kernel), then timed only if it passes: decode rows paired with
# native (k6v4-kivi with and without it), and the 8B step at batch 8 after 4K keys.
RUN=m17; source docs/lab/device-run-1205c/lib.sh
timeout 90 python3 -m bench.cuda_emulate_page_keys --mma --device > "$D/mma-check.txt" 2>&1
rc=$?; echo "== mma-check rc=$rc" | tee -a "$D/steps.txt" >&2
(( rc == 0 )) || exit 1
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kv-mma 120 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --decode-formats k6v4-kivi,k6v4-kivi:mma --interleave --pipelined --repeats 3 \
  --steps 16
step kt-8b-mma 100 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8,k6v4-kivi:mma@8 --untraced 3 --top 6
