#!/usr/bin/env bash
# Session 8 device batch A: fused projections and MLX CUDA graph knobs, B1/B8 decode, SmolLM2 shape.
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
export PYTHONPATH=$S/site:$S/site2:$PWD
mkdir -p $S/shape && cp .device/smol-shape/* $S/shape/ && (cd $S/shape && xz -dkf tokenizer.json.xz)
B="python3 -m bench.engine --shaped-like $S/shape --prefill= --batches 1,8 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check"
run() { tag=$1; shift; t0=$(date +%s); echo "== $tag $*" >&2
  env "$@" > $OUT/$tag.json 2> $OUT/$tag.log; echo "rc=$? ${tag} $(( $(date +%s)-t0 ))s" >&2
  grep -h '"batch"' $OUT/$tag.log | cut -c1-400 >&2; }
run fused       $B
run unfused     $B --no-fuse
run bothfused   $B --ref-fused
run ops64       MLX_MAX_OPS_PER_BUFFER=64 $B
run ops200      MLX_MAX_OPS_PER_BUFFER=200 $B
run cache1000   MLX_CUDA_GRAPH_CACHE_SIZE=1000 $B
run fused2      $B
run unfused2    $B --no-fuse
