#!/usr/bin/env bash
# Third run of the 2026-12-06 lease: the page-key decode kernel's split plan swept (bench.kv
# decode specs `FORMAT:split-T[-K]`, each paired with native at its default plan in one
# process), at the rows the bars name (batch 8 at 4K and 32K keys), and the 8B step at
# batch 8 per plan. Default plan (cuda/packed_decode_v2.TARGET_BLOCKS 2112, 256 keys a split at
# least, at most 64 splits): 16 splits at 4K, 64 at 32K.
RUN=m15; source docs/lab/device-run-1205c/lib.sh
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kv-split 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 8 --interleave --pipelined --repeats 3 --steps 16 --decode-formats \
  k6v4-kivi,k6v4-kivi:split-528,k6v4-kivi:split-1056,k6v4-kivi:split-4224-128,native:split-2112
step kt-8b-split 150 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --variants native@8,k6v4-kivi@8,k6v4-kivi:split-512@8,k6v4-kivi:split-4224-128@8 \
  --untraced 3 --top 6
