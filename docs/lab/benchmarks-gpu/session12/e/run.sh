#!/usr/bin/env bash
# Session 12 device batch E (typed as one command on the machine batch D had staged): packed
# decode against native once more, with more rounds at 32K batch 8.
S=$(dirname "$(mktemp -u)"); export PYTHONPATH=$S/site:$S/site2:$PWD; D=$S/e; mkdir -p $D
KV="python3 -m bench.kv --geometry gpu --sections decode --pipelined --interleave"
timeout 80 $KV --decode 32768 --batches 8 --decode-formats int4,int8 --steps 64 --repeats 5 --out $D/kv32k_5.json >/dev/null 2>$D/kv32k_5.log; echo rc=$?
timeout 60 $KV --decode 4096 --batches 1 --decode-formats int4,int8 --steps 128 --repeats 5 --out $D/kv4k_3.json > /dev/null 2>$D/kv4k_3.log; echo rc=$?
tar czf $OUT/e.tar.gz -C $S e
