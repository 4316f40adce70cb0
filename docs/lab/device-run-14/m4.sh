#!/usr/bin/env bash
# Ran at commit a4436e8, on an H100 (an H200 was asked for each run, none lent).
# Fourth run of device run 14 (2026-12-06): m2-m3 found the warp-page kernel no faster in the step
# than the block-tiled one; is it, too, bound by its copies' access pattern? The phase probe's
# warp-kernel variants (head-major rows, no metadata copies, copies alone) beside the
# block-tiled ones, at 32K batch 8 and the 8B shape at 4K batch 8.
RUN=m4; source docs/lab/device-run-1205c/lib.sh
step probe 420 python3 -m bench.device.page_key_phase_probe --rows gpu:32768:8,llama8b-2l:4096:8
