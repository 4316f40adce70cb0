#!/usr/bin/env bash
# Session 11 device batch E: compiled decode with rows padded to buckets. A served mix through
# one engine (plain / exact rows / row buckets, two rounds), the compiled check at batch sizes
# that pad (5 -> 8, 12, 33 -> 40), and one more SmolLM2-shape engine vs mlx-lm process.
# Everything lands in $OUT/e.tar.gz; a step starts only if its limit fits the budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/e; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-330}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/e.tar.gz -C $S e
}
step mix_1 120 python3 -m bench.decode_mix --shaped-like .device/smol-shape --requests 64 --max-num-seqs 32 --spread-s 2 --rounds 2
step padded 80 python3 -m bench.compiled_check --shaped-like .device/smol-shape --kv-formats native,int4 --batches 5,12,33 --steps 40
step smol_7 100 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check
