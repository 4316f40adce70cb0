#!/usr/bin/env bash
# Session 9 device batch E, run 3: the decode kernels' shortest history split
# (KernelChoices.decode_split_min_keys, native and packed alike) at 4K and 32K, pipelined.
set -u
S=$(dirname "$(mktemp -u)")   # the device's temp folder: MLX staged in $S/site, pydantic in $S/site2
export PYTHONPATH=$S/site:$S/site2:$PWD
mkdir -p $S/e3
for mk in 64 128 256 64 128 256; do
  n=$(ls $S/e3 | grep -c "mk$mk") ; tag=kv_decode_pipelined_mk${mk}_$n; t0=$(date +%s)
  timeout 100 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 --batches 1,8 --decode-formats int4,int8 --steps 64 --repeats 3 --pipelined --split-min-keys $mk --out $S/e3/$tag.json 2> $S/e3/$tag.log
  echo "== $tag rc=$? $(( $(date +%s)-t0 ))s" >&2; grep "decode ctx" $S/e3/$tag.log >&2
  tar czf $OUT/e3.tar.gz -C $S e3
done
