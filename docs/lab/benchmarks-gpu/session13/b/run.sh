#!/usr/bin/env bash
# Session 13 device batch B: the v2 packed decode kernel stores the step's own rows into the
# pool itself (no write kernel, no slot arithmetic). Correctness first (compiled steps with it
# against uncompiled steps that scatter: logits and pages, SmolLM2 shape int8/int4 and the 0.5B
# shape int4), then its kernels per step, then packed decode against native, 4K batch 1 and
# 32K batch 8, each twice.
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
GS=.devcarry/s13b/gpu-shape
step check_smol 100 python3 -m bench.compiled_check --shaped-like .device/smol-shape --kv-formats int8,int4 --batches 1,5,8,32 --steps 40
step check_gpu 60 python3 -m bench.compiled_check --shaped-like $GS --kv-formats int4 --batches 1,8 --steps 24
step graph_int4 60 python3 -m bench.step_graph --shaped-like $GS --batch 1 --prompt 4096 --kv-format int4 --parts kernels
KV="python3 -m bench.kv --geometry gpu --sections decode --pipelined --interleave"
step kv4k 60 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 7
step kv32k 110 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 7
step kv4k_2 60 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 7
step kv32k_2 110 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 7
