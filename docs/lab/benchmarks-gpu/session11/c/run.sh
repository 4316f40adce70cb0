#!/usr/bin/env bash
# Session 11 device batch C: the final tree's packed decode (int4/int8 at 4K batch 1 and 32K
# batch 8, interleaved with native), one more SmolLM2-shape process and one more packed prefill
# run. Everything lands in $OUT/c.tar.gz; a step starts only if its limit fits the budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/c; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-420}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/c.tar.gz -C $S c
}
KV="python3 -m bench.kv --geometry gpu --sections decode --pipelined --interleave"
step kv4k 100 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5
step kv32k 90 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 3
step smol_3 110 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check
step prefill_4 90 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3 --prefill-paths tiles
