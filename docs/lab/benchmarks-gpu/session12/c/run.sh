#!/usr/bin/env bash
# Session 12 device batch C: the native kernel's OWN variant (it writes the step's own keys)
# against numpy references at long contexts and splits; packed decode on the final tree (int4
# and int8, 4K batch 1 and 32K batch 8); the served mix through one engine.
# Everything lands in $OUT/c.tar.gz; a step starts only if its limit fits the run's budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/c; mkdir -p $D
T0=$(date +%s); BUDGET=${BUDGET:-560}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/c.tar.gz -C $S c
}
step check_native 90 python3 -m bench.cuda_check --kernels native
KV="python3 -m bench.kv --geometry gpu --sections decode --pipelined --interleave"
step kv4k 100 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5
step kv32k 100 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 3
step mix 260 python3 -m bench.decode_mix --shaped-like .device/smol-shape --requests 64 --max-num-seqs 32 --spread-s 2 --rounds 2
