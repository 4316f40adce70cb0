#!/usr/bin/env bash
# Ran at commit 904c18e (before the key metadata pairs and block shapes of c8a0f9c), on
# an H100 (an H200 was asked for each run, none lent).
# Second run of device run 14 (2026-12-06): the warp-page decode kernel
# (KernelChoices.page_key_warp_pages, engine/attention/cuda/page_key_warp_decode_source.py)
# checked on the GPU against the reference, then timed alone against the block-tiled kernel
# (the layer profile's kernel part: max diff beside) and in bench.kv's paired decode rows.
RUN=m2; source docs/lab/device-run-1205c/lib.sh
timeout 150 python3 -m bench.cuda_emulate_page_keys --warp-pages --device > "$D/check.txt" 2>&1
echo "== check rc=$?" | tee -a "$D/steps.txt" >&2
timeout 150 python3 -m bench.device.page_key_layer_profile \
  --rows gpu:32768:8,llama8b-2l:4096:8,gpu:4096:1,gpu:4096:8 --parts kernel --budget-s 120 \
  --out "$D/layer-profile.json" > "$D/layer-profile.log" 2>&1
echo "== layer-profile rc=$?" | tee -a "$D/steps.txt" >&2
step kv-warp 250 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 \
  --decode-formats k6v4-kivi,k6v4-kivi:warp-pages
