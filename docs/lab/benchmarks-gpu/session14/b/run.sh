#!/usr/bin/env bash
# Session 14 device batch B: the tree with RowPages (compiled steps keep page ids between
# steps). The packed decode bars again (32K batch 8, 4K batch 1), correctness of compiled steps
# on the device (SmolLM2 shape and the 0.5B shape: logits and pages against uncompiled steps),
# SmolLM2-shape engine vs mlx-lm (decode batch 1/8/32, prefill 512-8K), and 32K batch 8 with
# one CUDA graph per step (MLX_MAX_OPS_PER_BUFFER=1000) once more.
# Everything lands in $OUT/b.tar.gz; a step starts only if its limit fits the run's budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/b; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-560}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/b.tar.gz -C $S b
}
KV="python3 -m bench.kv --geometry gpu --sections decode --interleave --pipelined"
step kv32k 90 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 7
step kv4k 50 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 7
step check_smol 70 python3 -m bench.compiled_check --shaped-like .device/smol-shape --kv-formats int8,int4 --batches 1,5,8,32 --steps 40
step check_gpu 60 python3 -m bench.compiled_check --shaped-like .devcarry/s14b/gpu-shape --kv-formats int4 --batches 1,8 --steps 24
step smol 200 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check
step ops1000 50 env MLX_MAX_OPS_PER_BUFFER=1000 $KV --decode 32768 --batches 8 --decode-formats int4 --steps 64 --repeats 5
