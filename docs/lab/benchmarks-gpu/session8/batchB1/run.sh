#!/usr/bin/env bash
# Session 8 device batch B1: engine (fused projections, the default) vs engine --no-fuse, each
# beside mlx-lm in its own process, alternating; SmolLM2-135M's architecture, random bf16 weights.
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
export PYTHONPATH=$S/site:$S/site2:$PWD
mkdir -p $S/shape $S/b1 && cp .device/smol-shape/* $S/shape/
B="python3 -m bench.engine --shaped-like $S/shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check"
run() { tag=$1; shift; t0=$(date +%s); echo "== $tag $*" >&2
  env "$@" > $S/b1/$tag.json 2> $S/b1/$tag.log; echo "rc=$? ${tag} $(( $(date +%s)-t0 ))s" >&2
  grep -h '"batch"\|"prompt_tokens"' $S/b1/$tag.log | python3 -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l); k = 'batch' if 'batch' in d else 'prompt_tokens'
    print(k, d[k], 'ratio_best', d.get('ratio_wall'), 'median', d.get('ratio_wall_median'), d.get('ratios_wall'))" >&2
  tar czf $OUT/b1.tar.gz -C $S b1; }
run fused_a   $B
run unfused_a $B --no-fuse
run fused_b   $B
run unfused_b $B --no-fuse
