"""Compile the CUDA kernels' sources through NVRTC, the compiler MLX's cuda_kernel uses on the
device, without a GPU (a developer's check beside bench.cuda_nvcc_check).

    python -m bench.cuda_nvrtc_check [--only TEXT] [--arch compute_90] [--include DIR]

Why: nvcc accepting a kernel does not prove NVRTC will (it has no host headers and its own
built-ins), and a kernel that fails to build on the device fails every decode step there.
This takes libnvrtc from the PyPI wheel `nvidia-cuda-nvrtc` (found on sys.path, or
$ORCHARD_NVRTC), wraps each variant as bench.cuda_nvcc_check does, and compiles it to PTX with
the CUDA headers of the local toolkit (`--include`, default: nvcc's). Exit 2 without libnvrtc
or headers, 1 if a variant fails (its log printed).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
from pathlib import Path

from bench.cuda_nvcc_check import variants, wheel_files

# NVRTC has no C++ host headers: the prelude's <cstdint> becomes the two types the kernels use.
CSTDINT = "#include <cstdint>\n"
FIXED_WIDTH = "typedef unsigned int uint32_t;\ntypedef int int32_t;\n"


def find_nvrtc() -> str | None:
    """libnvrtc: $ORCHARD_NVRTC, else the nvidia-cuda-nvrtc wheel's on sys.path."""
    return os.environ.get("ORCHARD_NVRTC") or next(
        map(str, wheel_files("*/lib/libnvrtc.so*")), None)


def toolkit_include() -> Path | None:
    """The include folder of the nvcc on PATH (cuda_bf16.h and friends)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    for root in (Path(nvcc).resolve().parent.parent, Path("/usr/local/cuda")):
        if (root / "include" / "cuda_bf16.h").exists():
            return root / "include"
    return None


def compile_ptx(lib, source: str, options: list[str]) -> tuple[int, str]:
    """(NVRTC's result code, its log) for one source."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None)
    if rc:
        return rc, "nvrtcCreateProgram failed"
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="compile only labels containing this text")
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--include", type=Path, help="CUDA include folder (default: nvcc's)")
    args = ap.parse_args(argv)
    path, include = find_nvrtc(), args.include or toolkit_include()
    if path is None or include is None:
        print("needs libnvrtc (pip install nvidia-cuda-nvrtc, or ORCHARD_NVRTC) and the CUDA "
              "headers (nvcc on PATH, or --include)", file=sys.stderr)
        return 2
    lib = ctypes.CDLL(path)
    options = [f"--gpu-architecture={args.arch}", "-std=c++17", f"-I{include}",
               f"-I{include / 'cccl'}"]
    failed = 0
    for label, source in variants():
        if args.only not in label:
            continue
        rc, log = compile_ptx(lib, source.replace(CSTDINT, FIXED_WIDTH), options)
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {label}")
        if rc:
            failed += 1
            print(log[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
