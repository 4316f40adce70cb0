#!/usr/bin/env bash
# Session 13 device batch A (measure only, the tree of session 12 plus bench options): where
# packed decode loses to native. The attention kernels alone at several split plans
# (4K/32K x batch 1/8); kernels per step and the build / issue / wait split for native and int4
# on the 0.5B geometry (gpu-shape: bench.kv's "gpu" geometry as a model folder, SmolLM2's
# tokenizer); bench.kv's paired rounds with per-step intervals (32K batch 8, 4K batch 1), and
# 4K batch 1 with smaller splits for both kernels.
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
GS=.devcarry/s13a/gpu-shape
step kernels 90 python3 -m bench.decode_kernels --contexts 4096,32768 --batches 1,8 --kernels native,int4:v2,int8:v2 --min-keys 256,128,64 --rounds 20
KV="python3 -m bench.kv --geometry gpu --sections decode --pipelined --interleave"
step kv32k 90 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 5
step kv4k 90 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5
step graph_native 100 python3 -m bench.step_graph --shaped-like $GS --batch 1 --prompt 4096 --kv-format native
step graph_int4 100 python3 -m bench.step_graph --shaped-like $GS --batch 1 --prompt 4096 --kv-format int4
step kv4k_mk64 90 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5 --split-min-keys 64
