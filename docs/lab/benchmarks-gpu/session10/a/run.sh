#!/usr/bin/env bash
# Session 10 device batch A: compiled decode steps (engine/runner/compiled_decode.py).
# 1) correctness + synchronous step cost, compiled vs plain, on the CUDA kernel path;
# 2) host cost per step (bench.decode_host), compiled (default on CUDA) vs --no-compile;
# 3) SmolLM2 shape, engine vs mlx-lm, compiled vs --no-compile alternating.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
mkdir -p $OUT/a
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  timeout $lim "$@" --out $OUT/a/$tag.json > /dev/null 2> $OUT/a/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
}
step check_smol 120 python3 -m bench.compiled_check --shaped-like .device/smol-shape --batches 1,8,32 --steps 48
step host_compiled 90 python3 -m bench.decode_host --batches 1,8,32 --tokens 128 --repeats 3
step host_plain 90 python3 -m bench.decode_host --batches 1,8,32 --tokens 128 --repeats 3 --no-compile
for i in 1 2; do
  step smol_compiled_$i 100 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check
  step smol_plain_$i 100 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check --no-compile
done
