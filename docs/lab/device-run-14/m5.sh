#!/usr/bin/env bash
# Ran at commit c8a0f9c, on an H100 (an H200 was asked for each run, none lent).
# Fifth run of device run 14 (2026-12-06): m4 found the warp-page kernel's copies alone at 191 us of
# its 243 (32K batch 8): more pages in flight a warp. Its block shapes (warps a block x copy
# stages a warp: 4x2, 2x3, 2x4, 1x4; key metadata now copied in sector-sized pairs) checked on
# the GPU, then timed alone (the layer profile) and in bench.kv's paired rows.
RUN=m5; source docs/lab/device-run-1205c/lib.sh
for s in 2x3 1x4; do
  timeout 100 python3 -m bench.cuda_emulate_page_keys --warp-pages --warp-shape $s --device \
    > "$D/check-$s.txt" 2>&1
  echo "== check $s rc=$?" | tee -a "$D/steps.txt" >&2
done
timeout 200 python3 -m bench.device.page_key_layer_profile \
  --rows gpu:32768:8,llama8b-2l:4096:8,gpu:4096:1,gpu:4096:8 --parts kernel --budget-s 180 \
  --out "$D/layer-profile.json" > "$D/layer-profile.log" 2>&1
echo "== layer-profile rc=$?" | tee -a "$D/steps.txt" >&2
step kv-shapes 200 python3 -m bench.kv --geometry gpu --sections decode --decode 4096,32768 \
  --batches 1,8 --interleave --pipelined --repeats 3 --steps 16 \
  --decode-formats \
  k6v4-kivi,k6v4-kivi:warp-pages-2x3,k6v4-kivi:warp-pages-2x4,k6v4-kivi:warp-pages-1x4
