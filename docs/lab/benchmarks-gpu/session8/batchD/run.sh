#!/usr/bin/env bash
# Session 8 device batch D: packed decode (v2 default) synchronous vs pipelined (as the engine runs).
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
export PYTHONPATH=$S/site:$S/site2:$PWD
mkdir -p $S/d1
K="python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 --batches 1,8 --decode-formats int4,int8 --steps 64 --repeats 3"
for mode in pipelined sync pipelined2; do
  extra=""; case $mode in pipelined*) extra="--pipelined";; esac
  t0=$(date +%s); timeout 150 $K $extra --out $S/d1/kv_decode_$mode.json 2>&1 | grep "decode ctx" >&2
  echo "== $mode $(( $(date +%s)-t0 ))s" >&2; tar czf $OUT/d1.tar.gz -C $S d1
done
