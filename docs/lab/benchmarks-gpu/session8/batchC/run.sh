#!/usr/bin/env bash
# Session 8 device batch C: packed decode v2 correctness and speed (synthetic 0.5B GPU geometry).
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
export PYTHONPATH=$S/site:$S/site2:$PWD
mkdir -p $S/c1
step() { tag=$1; lim=$2; shift 2; t0=$(date +%s); echo "== $tag $*" >&2
  timeout $lim "$@" > $S/c1/$tag.out 2> $S/c1/$tag.log; echo "rc=$? $tag $(( $(date +%s)-t0 ))s" >&2
  tail -c 1500 $S/c1/$tag.log >&2; tar czf $OUT/c1.tar.gz -C $S c1; }
step check 150 python3 -m bench.cuda_check --kernels packed,packed-v2 --out $S/c1/cuda_check_v2.json
step kernels 120 python3 -m bench.decode_kernels --contexts 4096,32768 --batches 1,8 --out $S/c1/decode_kernels.json
step kv 240 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 --batches 1,8 --decode-formats int4:split,int4:v2,int8:split,int8:v2 --steps 32 --repeats 3 --out $S/c1/kv_decode_v2.json
