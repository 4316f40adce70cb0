#!/usr/bin/env bash
# Third run of the 2026-12-07 lease: the page-key kernel's tile loop phase by phase at the 32K
# batch-8 row (bench.device.page_key_phase_probe: each phase cut from the source in turn) and at
# 4K batch 8, after m2 found neither more resident blocks nor one wave of blocks helps.
RUN=m3; source docs/lab/device-run-1205c/lib.sh
step phases 200 python3 -m bench.device.page_key_phase_probe --rows gpu:32768:8,gpu:4096:8
step kv-bars 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 \
  --decode-formats k6v4-kivi,k6v4-kivi:mma+split-512
