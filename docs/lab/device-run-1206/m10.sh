#!/usr/bin/env bash
# First run of the next lease (staging first: bench/device/stage-mlx): the decode kernels'
# copies by row owner (page-key, packed v2, tiled native: 2026-12-06, bit-identical on the CPU
# emulator; SASS counts in docs/lab/benchmarks-kv-page-keys.md) checked on the GPU, then the
# decode rows the bars name, paired with native in one process.
RUN=m10; source docs/lab/device-run-1205c/lib.sh   # step, $W, $D, the staged site
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" \
  llama-3.2-1b llama-3.1-8b > "$D/shapes.log" 2>&1
timeout 60 python3 -m bench.cuda_emulate_native_tiled --device > "$D/native-tiled-check.txt" 2>&1
echo "== native-tiled-check rc=$?" | tee -a "$D/steps.txt" >&2
step v2check 60 python3 -m bench.cuda_check --kernels packed-v2
step stepcheck 90 python3 -m bench.page_key_step_check --model $W/llama-3.2-1b-random
step kv-decode 240 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --decode-formats k6v4-kivi,int8 --interleave --pipelined --repeats 2 --steps 16
