#!/usr/bin/env bash
# Ran at commit f85766c, on an H100 (an H200 was asked for each run, none lent).
# Eighth run of device run 14 (2026-12-06): m6 found the warp-page kernel's copies alone, at the
# most contiguous addressing, at 1.67 TB/s. Is it the 16-byte cp.async pieces' issue that tops
# out? Its page copies as Hopper bulk copies (one lane, six runs a page, an mbarrier a stage:
# bench/device/page_key_bulk_copies.py) against the same addressing in pieces.
RUN=m8; source docs/lab/device-run-1205c/lib.sh
step probe 240 python3 -m bench.device.page_key_phase_probe --rows gpu:32768:8,llama8b-2l:4096:8 \
  --variants warp,warp-loads-only,warp-head-pages,warp-loads-only-head-pages,warp-bulk,\
warp-loads-only-bulk
