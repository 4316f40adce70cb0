#!/usr/bin/env bash
# Session 8 device batch C: packed decode v2 correctness and speed (synthetic 0.5B GPU geometry).
set -u
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD
mkdir -p /tmp/c1
step() { tag=$1; lim=$2; shift 2; t0=$(date +%s); echo "== $tag $*" >&2
  timeout $lim "$@" > /tmp/c1/$tag.out 2> /tmp/c1/$tag.log; echo "rc=$? $tag $(( $(date +%s)-t0 ))s" >&2
  tail -c 1500 /tmp/c1/$tag.log >&2; tar czf $OUT/c1.tar.gz -C /tmp c1; }
step check 150 python3 -m bench.cuda_check --kernels packed,packed-v2 --out /tmp/c1/cuda_check_v2.json
step kernels 120 python3 -m bench.decode_kernels --contexts 4096,32768 --batches 1,8 --out /tmp/c1/decode_kernels.json
step kv 240 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 --batches 1,8 --decode-formats int4:split,int4:v2,int8:split,int8:v2 --steps 32 --repeats 3 --out /tmp/c1/kv_decode_v2.json
