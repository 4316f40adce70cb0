#!/usr/bin/env bash
# Session 10 device batch C: confirmation runs of the compiled-decode tree (commit in the
# session notes): SmolLM2 shape engine vs mlx-lm x4, int4/int8 4K B1 and 32K B8 interleaved,
# packed prefill x3. Everything lands in $OUT/c.tar.gz.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/c; mkdir -p $D
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/c.tar.gz -C $S c
}
KV="python3 -m bench.kv --geometry gpu --sections decode --pipelined --interleave"
for i in 1 2; do
  step smol_$i 90 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check
  step kv4k_$i 60 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5
  step prefill_$i 70 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3
done
step kv32k_1 60 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 3
for i in 3 4; do
  step smol_$i 90 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check
done
step prefill_3 70 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3
