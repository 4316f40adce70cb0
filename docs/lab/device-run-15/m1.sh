#!/usr/bin/env bash
# Ran at commit a45028b, on an H100 (an H200 was asked for; none lent).
# First run of device run 15 (2026-12-06): the warp-page kernel at pages of 32 and 64 on the GPU
# (its emulator cases), then bench.kv's paired decode rows at the engine's default page of 64
# (every page-key row until now ran at 16, where k6v4-kivi's per-page key scales cost 64 B a
# token at head dim 128: 0.47x native's bytes, against 0.375x at 64) for both kernels, and the
# Llama-3.1-8B shape at 4K batch 8 at pages of 64 (CUPTI, per step).
RUN=m1; source docs/lab/device-run-1205c/lib.sh
timeout 150 python3 -m bench.cuda_emulate_page_keys --warp-pages --limit 8 --device \
  > "$D/check.txt" 2>&1
echo "== check rc=$?" | tee -a "$D/steps.txt" >&2
step kv64 260 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 --page-tokens 64 \
  --decode-formats k6v4-kivi:block-tiled,k6v4-kivi:warp-pages
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.1-8b > "$D/shapes.log" 2>&1
step kt-8b-64 170 python3 -m bench.device.kernel_trace --model $W/llama-3.1-8b-random \
  --context 4096 --page-tokens 64 \
  --variants native@8,k6v4-kivi:block-tiled@8,k6v4-kivi:warp-pages@8 --untraced 3 --top 6
