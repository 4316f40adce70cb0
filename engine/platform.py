"""Platform setup shared by every process that runs MLX.

MLX's Linux CPU wheel links a reference BLAS; preloading OpenBLAS (Debian `libopenblas0-pthread`)
makes float32 matmul about 9x faster. LD_PRELOAD only takes effect at process start, so entry
points either re-exec themselves (`ensure_openblas_preloaded`) or pass `openblas_env()` to child
processes (Ray workers get it through `runtime_env`).

`python -m engine.platform exec CMD ...` runs CMD with the preload set (used by the Makefile).
"""
from __future__ import annotations

import os
import platform
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
_REEXEC_MARK = "ORCHARD_OPENBLAS_REEXEC"


def openblas_path() -> str | None:
    """The OpenBLAS library to preload, or None where it does not apply (macOS) or is missing."""
    if platform.system() != "Linux" or os.environ.get("ORCHARD_NO_OPENBLAS") == "1":
        return None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


# How long an OpenBLAS worker thread spins after its share of a GEMM before it sleeps: 2^n
# cycles, OpenBLAS's default n = 28 (~0.1 s). A CPU engine step alternates GEMMs with work on
# the engine thread alone (the Numba decode attention, NumPy softmax and sampling), and the
# worker spun through all of it on the other core, taking it from the serving processes beside
# the engine (Ray, the ingress, the client). At n = 4 it sleeps at once: a 16-row SmolLM2 decode
# step took the same wall time with 24 % less CPU, a 224-token prefill 20 % less
# (docs/lab/benchmarks-cpu-engine.md, "OpenBLAS's spinning workers"). A value already in the
# environment wins.
OPENBLAS_THREAD_TIMEOUT = "4"


def openblas_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that preload OpenBLAS into a child process (empty where N/A)."""
    path = openblas_path()
    if path is None:
        return {}
    env = base if base is not None else os.environ
    timeout = {"OPENBLAS_THREAD_TIMEOUT": env.get("OPENBLAS_THREAD_TIMEOUT",
                                                  OPENBLAS_THREAD_TIMEOUT)}
    current = env.get("LD_PRELOAD", "")
    if path in current.split(":"):
        return {"LD_PRELOAD": current, **timeout}
    return {"LD_PRELOAD": f"{path}:{current}" if current else path, **timeout}


def openblas_preloaded() -> bool:
    path = openblas_path()
    return path is not None and path in os.environ.get("LD_PRELOAD", "").split(":")


def ensure_openblas_preloaded() -> None:
    """Re-exec the current process with OpenBLAS preloaded, once, before MLX is imported."""
    if openblas_path() is None or openblas_preloaded() or os.environ.get(_REEXEC_MARK):
        return
    env = dict(os.environ, **openblas_env(), **{_REEXEC_MARK: "1"})
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "exec":
        print("usage: python -m engine.platform exec COMMAND [ARGS...]\n"
              "Runs COMMAND with OpenBLAS preloaded (Linux); on macOS runs it unchanged.",
              file=sys.stderr)
        return 2
    env = dict(os.environ, **openblas_env())
    os.execvpe(argv[1], argv[1:], env)
    return 0  # unreachable: execvpe replaces the process


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
