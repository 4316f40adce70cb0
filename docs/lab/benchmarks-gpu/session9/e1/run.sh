#!/usr/bin/env bash
# Session 9 device batch E, run 1: the one-pool page layout (engine.kv.page_layout) on the H200:
# kernel correctness, packed decode (pipelined as the engine runs, then synchronous) and packed
# prefill vs native, synthetic 0.5B geometry, bf16.
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
export PYTHONPATH=$S/site:$S/site2:$PWD
mkdir -p $S/e1
step() { tag=$1; lim=$2; shift 2; t0=$(date +%s); echo "== $tag $*" >&2
  timeout $lim "$@" > $S/e1/$tag.out 2> $S/e1/$tag.log; rc=$?; echo "rc=$rc $tag $(( $(date +%s)-t0 ))s" >&2
  grep -h "decode ctx\|prefill ctx\|prefill [0-9]\|ok\|FAIL\|Error" $S/e1/$tag.log | tail -40 >&2
  tar czf $OUT/e1.tar.gz -C $S e1; return $rc; }
step check 180 python3 -m bench.cuda_check --kernels native,packed,packed-v2,write,prefill --out $S/e1/cuda_check.json
K="python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 --batches 1,8 --decode-formats int4,int8 --steps 64 --repeats 3"
step kvdec_pipe 150 $K --pipelined --out $S/e1/kv_decode_pipelined.json
step kvpre 150 python3 -m bench.kv --geometry gpu --sections prefill --prefill 4096,16384 --prefill-formats int8,int4 --repeats 3 --out $S/e1/kv_prefill.json
step kvdec_sync 100 $K --out $S/e1/kv_decode_sync.json
