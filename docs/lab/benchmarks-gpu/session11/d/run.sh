#!/usr/bin/env bash
# Session 11 device batch D: more SmolLM2-shape batch-1 decode samples (engine vs mlx-lm in
# each process), three processes. Everything lands in $OUT/d.tar.gz.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/d; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-300}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/d.tar.gz -C $S d
}
for i in 4 5 6; do
  step smol_$i 90 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 8192 --batches 1 --decode-prompt 128 --decode-tokens 128 --repeats 9 --warmup 1 --no-openblas-check
done
