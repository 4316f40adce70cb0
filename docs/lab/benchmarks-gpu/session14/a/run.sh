#!/usr/bin/env bash
# Session 14 device batch A: packed decode at 32K batch 8, pipelined. Compiled steps now keep
# each row's page ids between steps (no per-step list conversion or Python range check), and
# pipelined rounds record build / issue / wait (wait = the previous step's result). Variants
# that change how MLX issues a step: one CUDA graph per step (MLX_MAX_OPS_PER_BUFFER=1000,
# default 100 on the H200: two graphs a step), no CUDA graphs (MLX_USE_CUDA_GRAPHS=0).
# Everything lands in $OUT/a.tar.gz; a step starts only if its limit fits the run's budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/a; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-560}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/a.tar.gz -C $S a
}
KV="python3 -m bench.kv --geometry gpu --sections decode --interleave"
P32="--pipelined --decode 32768 --batches 8"
step kv32k 110 $KV $P32 --decode-formats int4,int8 --steps 64 --repeats 7
step sync32k 70 $KV --decode 32768 --batches 8 --decode-formats int4 --steps 32 --repeats 3
step ops1000 80 env MLX_MAX_OPS_PER_BUFFER=1000 $KV $P32 --decode-formats int4 --steps 64 --repeats 5
step nographs 80 env MLX_USE_CUDA_GRAPHS=0 $KV $P32 --decode-formats int4 --steps 64 --repeats 5
step kv4k 60 $KV --pipelined --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 7
step kv32k_2 110 $KV $P32 --decode-formats int4,int8 --steps 64 --repeats 7
