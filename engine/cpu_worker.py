"""The one parked worker thread that CPU steps split their NumPy and Numba work onto.

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


def parked_worker() -> ThreadPoolExecutor:
    """The process's one worker thread, started on first use."""
    global _WORKER
    if _WORKER is None:
        _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-cpu-worker")
    return _WORKER
