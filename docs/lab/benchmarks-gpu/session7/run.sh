#!/bin/bash
S=$(dirname "$(mktemp -u)")   # the device's temp folder (staged there by the runs in benchmarks-gpu.md)
# Session 7 on the H200 (third run of the session, after the two staging runs): the engine
# before (12fb429) and after this change, each beside mlx-lm in its own process, processes
# alternating, every line of results appended to $OUT/results.jsonl as it comes.
# Trees: $S/gd/trees/{old,new} (engine/ and capacity/ of each commit, bench/ of the new one
# for both); MLX + mlx-lm in $S/site, pydantic in $S/site2; SmolLM2's config and tokenizer
# in $S/gd/smol-shape (random bf16 weights drawn by bench.engine --shaped-like).
set -u
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-540}            # seconds this script may use (the run's limit is 600)
SMOL=$S/gd/smol-shape
AB="--prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5"
last=0
step() {   # step SIDE TAG MODULE ARGS...: one process, its JSON appended under a tag
  local side=$1 tag=$2 module=$3; shift 3
  local left=$((LIMIT - SECONDS))
  if [ $left -lt $((last + 20)) ]; then echo "skip $tag ($left s left)" >> $OUT/log.txt; return; fi
  local t0=$SECONDS
  echo "== $tag ($side) at ${SECONDS}s" >> $OUT/log.txt
  (cd $S/gd/trees/$side && PYTHONPATH=$S/site:$S/site2:$S/gd/trees/$side \
     timeout $((left - 5)) python3 -m $module "$@" --out $S/gd/out.json) >> $OUT/log.txt 2>&1
  last=$((SECONDS - t0))
  python3 -c "import json,sys; r=json.load(open('$S/gd/out.json')); print(json.dumps({'tag': sys.argv[1], 'side': sys.argv[2], 'seconds': int(sys.argv[3]), 'result': r}))" \
    "$tag" "$side" "$last" >> $OUT/results.jsonl 2>> $OUT/log.txt
  rm -f $S/gd/out.json
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv >> $OUT/log.txt 2>&1
(cd $S/gd/trees && find old new -name '*.py' | sort | xargs md5sum | md5sum) >> $OUT/log.txt
# Host cost per decode step on a SmolLM2-layered tiny model (hidden 72): engine vs mlx-lm.
step new host-new-1 bench.decode_host --batches 1,8,32 --tokens 128 --repeats 3
step old host-old-1 bench.decode_host --batches 1,8,32 --tokens 128 --repeats 3
# SmolLM2-135M architecture, random bf16 weights: engine vs mlx-lm, old and new alternating.
step old ab-old-1 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step new ab-new-1 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step new ab-new-2 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step old ab-old-2 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step old ab-old-3 bench.engine --shaped-like $SMOL $AB --no-openblas-check
step new ab-new-3 bench.engine --shaped-like $SMOL $AB --no-openblas-check
echo "end at ${SECONDS}s" >> $OUT/log.txt
