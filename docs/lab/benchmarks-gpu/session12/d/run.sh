#!/usr/bin/env bash
# Session 12 device batch D: packed decode writes its records into the pool in place (the write
# kernel's in-place variant, no record scatter). Compiled + in-place against uncompiled +
# scatter, step by step (int8, int4); packed decode against native (4K batch 1, 32K batch 8).
# Everything lands in $OUT/d.tar.gz; a step starts only if its limit fits the run's budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/d; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-400}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/d.tar.gz -C $S d
}
step check 110 python3 -m bench.compiled_check --shaped-like .device/smol-shape --kv-formats int8,int4 --batches 1,5,8,32 --steps 40
KV="python3 -m bench.kv --geometry gpu --sections decode --pipelined --interleave"
step kv4k 100 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5
step kv32k 70 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 3
step kv4k_2 100 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5
