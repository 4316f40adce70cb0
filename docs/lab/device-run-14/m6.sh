#!/usr/bin/env bash
# Ran at commit bb1ab55, on an H100 (an H200 was asked for each run, none lent).
# Sixth run of device run 14 (2026-12-06): m5 found more pages in flight a warp no faster, so the
# copy path is bound by what it asks of memory, not by latency. How much would a page layout
# whose (page, head) is one contiguous run of its sections (`head-pages`) give, against
# head-major sections (`head-major`) and today's token-major rows, with and without compute?
RUN=m6; source docs/lab/device-run-1205c/lib.sh
step probe 300 python3 -m bench.device.page_key_phase_probe --rows gpu:32768:8,llama8b-2l:4096:8 \
  --variants full,loads-only,warp,warp-loads-only,warp-head-major,\
warp-loads-only-head-major,warp-head-pages,warp-loads-only-head-pages
