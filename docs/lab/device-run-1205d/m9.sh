#!/usr/bin/env bash
# What a nearly spent device budget allows: the GPU check of compiled page-key steps with the
# tails written in place (on by default) and the OWN decode kernel, against the MLX write, bit
# for bit; then the 4K decode rows with and without `:own-write` if time is left.
RUN=m9; source docs/lab/device-run-1205c/lib.sh   # shared with the afternoon lease
python3 -m bench.device.shaped_models --tokenizer-from .device/mlx/p5/tok --out "$W" llama-3.2-1b \
  > "$D/shapes.log" 2>&1
step stepcheck 90 python3 -m bench.page_key_step_check --model $W/llama-3.2-1b-random
step kv-decode 120 python3 -m bench.kv --geometry gpu --sections decode --decode 4096 \
  --batches 1,8 --decode-formats k6v4-kivi,k6v4-kivi:own-write --interleave --pipelined \
  --repeats 2 --steps 16
