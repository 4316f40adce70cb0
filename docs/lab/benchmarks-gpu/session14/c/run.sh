#!/usr/bin/env bash
# Session 14 device batch C: the packed decode bars once more on this tree (fresh processes on
# a fresh machine), and SmolLM2-shape engine vs mlx-lm with one CUDA graph per step
# (MLX_MAX_OPS_PER_BUFFER=1000, both sides in one process) beside batch B's MLX defaults.
# Everything lands in $OUT/c.tar.gz; a step starts only if its limit fits the run's budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/c; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-400}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/c.tar.gz -C $S c
}
KV="python3 -m bench.kv --geometry gpu --sections decode --interleave --pipelined"
step kv4k 60 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 7
step kv32k 90 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 7
step smol_ops1000 150 env MLX_MAX_OPS_PER_BUFFER=1000 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check
step kv4k_2 60 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 7
