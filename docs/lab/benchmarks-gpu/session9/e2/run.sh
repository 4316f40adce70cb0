#!/usr/bin/env bash
# Session 9 device batch E, run 2: SmolLM2-135M's architecture (random bf16 weights) engine vs
# mlx-lm in one process, three times; then packed decode pipelined once more (0.5B geometry).
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
export PYTHONPATH=$S/site:$S/site2:$PWD
mkdir -p $S/shape $S/e2 && cp .device/smol-shape/* $S/shape/
B="python3 -m bench.engine --shaped-like $S/shape --prefill 512,2048,8192 --batches 1,8,32 --decode-prompt 128 --decode-tokens 128 --repeats 5 --warmup 1 --no-openblas-check"
run() { tag=$1; lim=$2; shift 2; t0=$(date +%s); echo "== $tag $*" >&2
  timeout $lim "$@" > $S/e2/$tag.json 2> $S/e2/$tag.log; echo "rc=$? ${tag} $(( $(date +%s)-t0 ))s" >&2
  grep -h '"batch"\|"prompt_tokens"' $S/e2/$tag.log | python3 -c "
import sys, json
for l in sys.stdin:
    try: d = json.loads(l)
    except ValueError: continue
    k = 'batch' if 'batch' in d else 'prompt_tokens'
    print(k, d[k], 'median', d.get('ratio_wall_median'), d.get('ratios_wall'))" >&2
  tar czf $OUT/e2.tar.gz -C $S e2; }
run kvdec_pipe2 150 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 --batches 1,8 --decode-formats int4,int8 --steps 64 --repeats 3 --pipelined --out $S/e2/kv_decode_pipelined2.json
tag=kvdec_pipe_b1; t0=$(date +%s); timeout 100 python3 -m bench.kv --geometry gpu --sections decode --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5 --pipelined --out $S/e2/kv_decode_pipelined_b1.json 2>&1 | grep "decode ctx" >&2; echo "== $tag $(( $(date +%s)-t0 ))s" >&2
tar czf $OUT/e2.tar.gz -C $S e2
run engine_a 140 $B
run engine_b 140 $B
run engine_c 140 $B
