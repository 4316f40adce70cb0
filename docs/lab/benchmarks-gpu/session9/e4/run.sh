#!/usr/bin/env bash
# Session 9 device batch E, run 4: the one-pool layout (this tree, "new") against the six-array
# layout of the previous main (commit e209949, copied beside as .devcarry/old, "old"),
# alternating old/new in one warm machine: packed prefill, then packed decode pipelined.
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
mkdir -p $S/e4
for i in 1 2; do for tree in old new; do
  root=$PWD; [ $tree = old ] && root=$PWD/.devcarry/old
  tag=prefill_${tree}_$i; t0=$(date +%s)
  (cd $root && PYTHONPATH=$S/site:$S/site2:$root timeout 80 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3 --out $S/e4/$tag.json > /dev/null 2> $S/e4/$tag.log)
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/e4.tar.gz -C $S e4
done; done
for i in 1 2; do for tree in old new; do
  root=$PWD; [ $tree = old ] && root=$PWD/.devcarry/old
  tag=decode_${tree}_$i; t0=$(date +%s)
  (cd $root && PYTHONPATH=$S/site:$S/site2:$root timeout 80 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 --batches 1,8 --decode-formats int4,int8 --steps 64 --repeats 3 --pipelined --out $S/e4/$tag.json > /dev/null 2> $S/e4/$tag.log)
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2; grep "decode ctx" $S/e4/$tag.log >&2
  tar czf $OUT/e4.tar.gz -C $S e4
done; done
