#!/bin/bash
S=$(dirname "$(mktemp -u)")   # the device's temp folder (staged there by the runs in benchmarks-gpu.md)
# Session 7, third device batch (fresh machine, staged again): decode only, old (12fb429) vs
# new (with the batch-1 slice-update write), alternating, one warm-up run per side and point,
# 7 repeats; host ms per step on the tiny SmolLM2-layered model for both first.
set -u
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-420}
SMOL=$S/gd/smol-shape
AB="--prefill= --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 7 --warmup 1"
last=0
step() {
  local side=$1 tag=$2 module=$3; shift 3
  local left=$((LIMIT - SECONDS))
  if [ $left -lt $((last + 20)) ]; then echo "skip $tag ($left s left)" >> $OUT/log3.txt; return; fi
  local t0=$SECONDS
  echo "== $tag ($side) at ${SECONDS}s" >> $OUT/log3.txt
  (cd $S/gd/trees/$side && PYTHONPATH=$S/site:$S/site2:$S/gd/trees/$side \
     timeout $((left - 5)) python3 -m $module "$@" --out $S/gd/out.json) >> $OUT/log3.txt 2>&1
  last=$((SECONDS - t0))
  python3 -c "import json,sys; r=json.load(open('$S/gd/out.json')); print(json.dumps({'tag': sys.argv[1], 'side': sys.argv[2], 'seconds': int(sys.argv[3]), 'result': r}))" \
    "$tag" "$side" "$last" >> $OUT/results3.jsonl 2>> $OUT/log3.txt
  rm -f $S/gd/out.json
}
(cd $S/gd/trees && find old new -name '*.py' | sort | xargs md5sum | md5sum) >> $OUT/log3.txt
step old host3-old bench.decode_host --batches 1,8 --tokens 128 --repeats 3
step new host3-new bench.decode_host --batches 1,8 --tokens 128 --repeats 3
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then a=old; b=new; else a=new; b=old; fi
  step $a ab3-$a-$i bench.engine --shaped-like $SMOL $AB --no-openblas-check
  step $b ab3-$b-$i bench.engine --shaped-like $SMOL $AB --no-openblas-check
done
echo "end at ${SECONDS}s" >> $OUT/log3.txt
