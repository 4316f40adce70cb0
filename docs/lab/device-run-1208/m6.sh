#!/usr/bin/env bash
# Sixth run of the 2026-12-08 lease: m5 found more pages in flight a warp no faster, so the
# copy path is bound by what it asks of memory, not by latency. How much would a page layout
# whose (page, head) is one contiguous run of its sections (`head-pages`) give, against
# head-major sections (`head-major`) and today's token-major rows, with and without compute?
RUN=m6; source docs/lab/device-run-1205c/lib.sh
step probe 300 python3 -m bench.device.page_key_phase_probe --rows gpu:32768:8,llama8b-2l:4096:8 \
  --variants full,loads-only,warp,warp-loads-only,warp-head-major,warp-loads-only-head-major,warp-head-pages,warp-loads-only-head-pages
