#!/usr/bin/env bash
# Session 11 device batch B: the default packed prefill path (now "dequant") beside the tile
# kernel and native, three more runs; SmolLM2-shape engine vs mlx-lm (8K prefill, decode B1/8/32).
# Everything lands in $OUT/b.tar.gz; a step starts only if its limit fits the run's budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/b; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-570}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/b.tar.gz -C $S b
}
PF="python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3 --prefill-paths tiles"
SMOL="python3 -m bench.engine --shaped-like .device/smol-shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check"
step prefill_1 120 $PF
step smol_1 110 $SMOL
step prefill_2 90 $PF
step smol_2 110 $SMOL
step prefill_3 90 $PF
