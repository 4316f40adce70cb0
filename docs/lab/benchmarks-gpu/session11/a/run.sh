#!/usr/bin/env bash
# Session 11 device batch A: the history-dequant packed prefill path (cuda/packed_dequant.py)
# checked against references, then timed beside the tile kernel and native three times; the
# compiled decode step's first-step (trace) cost.
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
PF="python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3 --prefill-dequant"
step check 120 python3 -m bench.cuda_check --kernels dequant,prefill
step prefill_1 130 $PF
step compiled 90 python3 -m bench.compiled_check --shaped-like .device/smol-shape --kv-formats native,int8,int4 --batches 1,8,32 --steps 40
step prefill_2 110 $PF
step prefill_3 110 $PF
