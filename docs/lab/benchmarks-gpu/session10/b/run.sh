#!/usr/bin/env bash
# Session 10 device batch B: compiled decode for packed formats too; int4 4K B1 interleaved;
# SmolLM2 shape B1 + 8K prefill; packed prefill repeats. Everything lands in $OUT/b.tar.gz.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/b; mkdir -p $D
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/b.tar.gz -C $S b
}
step check 150 python3 -m bench.compiled_check --shaped-like .device/smol-shape --kv-formats native,int8,int4 --batches 1,8 --steps 40
KV="python3 -m bench.kv --geometry gpu --sections decode --pipelined --interleave"
step kv4k_compiled_1 90 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5
step kv4k_plain_1 90 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5 --no-compile
step kv32k_compiled_1 90 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 3
step kv4k_compiled_2 90 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5
for i in 1 2; do
  step smol_$i 70 python3 -m bench.engine --shaped-like .device/smol-shape --prefill 8192 --batches 1 --decode-prompt 128 --decode-tokens 128 --repeats 7 --warmup 1 --no-openblas-check
done
for i in 1 2; do
  step prefill_$i 80 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3
done
