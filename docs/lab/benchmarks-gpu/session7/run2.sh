#!/bin/bash
S=$(dirname "$(mktemp -u)")   # the device's temp folder (staged there by the runs in benchmarks-gpu.md)
# Session 7, second device batch (fresh machine, staged again): a cProfile of the new engine
# thread's decode steps on the tiny SmolLM2-layered model, then old/new alternating with one
# unrecorded warm-up run per side and point (bench.engine --warmup 1) and 6 repeats.
set -u
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-560}
SMOL=$S/gd/smol-shape
AB="--prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 6 --warmup 1"
last=0
step() {
  local side=$1 tag=$2 module=$3; shift 3
  local left=$((LIMIT - SECONDS))
  if [ $left -lt $((last + 20)) ]; then echo "skip $tag ($left s left)" >> $OUT/log2.txt; return; fi
  local t0=$SECONDS
  echo "== $tag ($side) at ${SECONDS}s" >> $OUT/log2.txt
  (cd $S/gd/trees/$side && PYTHONPATH=$S/site:$S/site2:$S/gd/trees/$side \
     timeout $((left - 5)) python3 -m $module "$@" --out $S/gd/out.json) >> $OUT/log2.txt 2>&1
  last=$((SECONDS - t0))
  python3 -c "import json,sys; r=json.load(open('$S/gd/out.json')); print(json.dumps({'tag': sys.argv[1], 'side': sys.argv[2], 'seconds': int(sys.argv[3]), 'result': r}))" \
    "$tag" "$side" "$last" >> $OUT/results2.jsonl 2>> $OUT/log2.txt
  rm -f $S/gd/out.json
}
(cd $S/gd/trees && find old new -name '*.py' | sort | xargs md5sum | md5sum) >> $OUT/log2.txt
step new prof-new bench.decode_host --batches 1,32 --tokens 64 --repeats 2 --no-mlx-lm --profile $OUT/profile-new.txt
last=0
step old ab2-old-1 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step new ab2-new-1 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step new ab2-new-2 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step old ab2-old-2 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step old ab2-old-3 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step new ab2-new-3 bench.engine --shaped-like $SMOL $AB --no-openblas-check
echo "end at ${SECONDS}s" >> $OUT/log2.txt
