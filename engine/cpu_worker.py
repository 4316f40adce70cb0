"""The one parked worker thread that CPU steps split their NumPy and Numba work onto, and how
their Numba kernels are compiled.

On the CPU an engine step alternates OpenBLAS GEMMs (which use both cores, their workers
sleeping right after: engine/platform.py OPENBLAS_THREAD_TIMEOUT) with work on the engine
thread alone: attention kernels, activations. That work is cut in two where it is large enough
to pay for the hand-off: the calling thread takes one part and this worker the other, so the
second core is not idle through it. One thread for every kernel of the process (the decode and
prefill attention kernels, the SwiGLU): calls from one engine thread never overlap, and engines
on several threads queue on it rather than multiplying spinning threads.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

_WORKER: ThreadPoolExecutor | None = None


def import_numba(kernel: str):
    """Numba (a declared dependency, imported only where a CPU kernel runs), or an ImportError
    naming `kernel` and what to do instead."""
    try:
        import numba
    except ImportError as e:
        raise ImportError(f"the {kernel} needs numba (pip install numba), or turn its "
                          "KernelChoices field off") from e
    return numba


def nogil_kernel(fn, kernel: str):
    """`fn` compiled by Numba as every CPU kernel here is: fast math, the machine code cached
    beside its file (a replica's warm-up pays the compile once per machine), the GIL released
    so the parked worker and the calling thread run it at once."""
    return import_numba(kernel).njit(fastmath=True, cache=True, nogil=True)(fn)


def parked_worker() -> ThreadPoolExecutor:
    """The process's one worker thread, started on first use."""
    global _WORKER
    if _WORKER is None:
        _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-cpu-worker")
    return _WORKER


def in_two(run, m: int, n: int) -> None:
    """run(0, m) on the calling thread and run(m, n) on the parked worker at once, for a
    kernel cut at m of n rows or queries; m == 0: run(0, n) here alone."""
    if not m:
        run(0, n)
        return
    half = parked_worker().submit(run, m, n)
    run(0, m)
    half.result()
