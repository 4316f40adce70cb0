#!/usr/bin/env bash
# Session 9 device batch E, run 5: packed prefill with record columns built on the device
# ("new") against the six-array layout of the previous main (e209949 as .devcarry/old, "old"),
# alternating in one warm machine.
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
mkdir -p $S/e5
for i in 1 2; do for tree in new old; do
  root=$PWD; [ $tree = old ] && root=$PWD/.devcarry/old
  tag=prefill_${tree}_$i; t0=$(date +%s)
  (cd $root && PYTHONPATH=$S/site:$S/site2:$root timeout 60 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3 --out $S/e5/$tag.json > /dev/null 2> $S/e5/$tag.log)
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/e5.tar.gz -C $S e5
done; done
