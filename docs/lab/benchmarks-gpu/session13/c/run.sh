#!/usr/bin/env bash
# Session 13 device batch C: why packed decode at 32K batch 8 sits at native's step time
# (batch B: every format ~4.9 ms a step). CUDA graph nodes per step per format (MLX's dot
# dumps; 4K/32K x batch 1/8), synchronous steps split into build / issue / wait, the kernels
# alone with and without the own-row store; then the SmolLM2-shape correctness check batch B
# missed (its folder was not carried) and the bars again.
# Everything lands in $OUT/c.tar.gz; a step starts only if its limit fits the run's budget.
set -u
S=$(dirname "$(mktemp -u)")
export PYTHONPATH=$S/site:$S/site2:$PWD
D=$S/c; mkdir -p $D/dots
T0=$(date +%s); BUDGET=${BUDGET:-560}
step() {  # tag, timeout, command...
  local tag=$1 lim=$2; shift 2; local t0=$(date +%s)
  if (( t0 - T0 + lim > BUDGET )); then echo "== $tag skipped (budget)" >&2; return; fi
  timeout $lim "$@" --out $D/$tag.json > /dev/null 2> $D/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2
  tar czf $OUT/c.tar.gz --exclude c/dots -C $S c
}
KV="python3 -m bench.kv --geometry gpu --sections decode --interleave"
step nodes 110 env MLX_SAVE_CUDA_GRAPHS_DOT_FILE=$D/dots/g $KV --pipelined --decode 4096,32768 --batches 1,8 --decode-formats int4,int8 --steps 16 --repeats 1 --graph-dots $D/dots
rm -rf $D/dots
step sync32k 80 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 32 --repeats 3
step kernels 40 python3 -m bench.decode_kernels --contexts 4096,32768 --batches 1,8 --kernels native,int4:v2,int4:v2own,int8:v2,int8:v2own --rounds 20
step check_smol 60 python3 -m bench.compiled_check --shaped-like .device/smol-shape --kv-formats int8,int4 --batches 1,5,8,32 --steps 40
step kv4k 60 $KV --pipelined --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 7
step kv32k 90 $KV --pipelined --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 7
step kv4k_2 60 $KV --pipelined --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 7
