#!/usr/bin/env bash
# Session 12 device batch B: the native decode kernel writes each step's own keys into the pages
# itself (no scatter, no page copies). Correctness (compiled + own writes against uncompiled +
# scatter, step by step), kernels per step and the build / issue / wait split, then engine vs
# mlx-lm at batch 1 (several processes) and one full SmolLM2-shape point set.
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
SH=.device/smol-shape
step check 100 python3 -m bench.compiled_check --shaped-like $SH --kv-formats native,int4 --batches 1,5,8,32 --steps 40
step graph_b1 150 python3 -m bench.step_graph --shaped-like $SH --batch 1
SM="python3 -m bench.engine --shaped-like $SH --prefill= --batches 1 --decode-prompt 128 --decode-tokens 128 --repeats 9 --warmup 1 --no-openblas-check"
step smol_b1_1 80 $SM
step smol_b1_2 80 $SM
step smol_full 120 python3 -m bench.engine --shaped-like $SH --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check
step smol_b1_3 80 $SM
step graph_b8 100 python3 -m bench.step_graph --shaped-like $SH --batch 8 --parts time
