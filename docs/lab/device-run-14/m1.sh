#!/usr/bin/env bash
# Ran at commit fd9faac, on an H100 (an H200 was asked for each run, none lent).
# First run of device run 14 (2026-12-06): is the page-key kernel's copy path bound by its access
# pattern (each head's rows interleaved with the other heads' in every section of a page,
# [PT][HK][width]) or by its small metadata pieces? bench.device.page_key_phase_probe's
# addressing variants (head-major rows, no metadata copies) beside its phase cuts, at 32K batch
# 8, the 8B shape at 4K batch 8 and 4K batch 8.
RUN=m1; source docs/lab/device-run-1205c/lib.sh
step probe 420 python3 -m bench.device.page_key_phase_probe \
  --rows gpu:32768:8,llama8b-2l:4096:8,gpu:4096:8
