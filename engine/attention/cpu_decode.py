"""Decode attention on the CPU straight from float32 pages, in one compiled loop (Numba).

A decode row's attention is small matrix-vector work over its history: a few query heads per
KV head against a few hundred keys. MLX's CPU path for it (`paged_decode_attention`: one
`gather_mm` per (row, head, page), a mask, a softmax, a second `gather_mm` and a sum over
page partials) ran at about 2 GB/s of history read, and it was 38-45 % of a served SmolLM2
decode step at 16-32 rows (bench/cpu_profile.py; docs/lab/benchmarks-cpu-engine.md). Here one
Numba kernel walks each row's page table itself: per (row, KV head) it reads every key once
for the scores, runs the softmax in registers' reach and reads every value once, so the step
reads the history near memory speed with no mask, padding or partial arrays built.

Numba (a maintained JIT for NumPy loops) compiles the kernel on first use and caches the
machine code beside this file (`cache=True`), so a process pays the ~3 s compile once per
machine, in a replica's warm-up. The kernel keeps no state and releases the GIL (`nogil`), so
engines on several threads may call it at once. With Numba's thread pool (`parallel=True`) its
idle workers spun against OpenBLAS's between layers and the step's GEMMs slowed by more than the
kernel gained (bench/cpu_profile.py, 16 rows). Instead a step of at least SPLIT_MIN_ROWS rows is
cut in two halves of about equal keys: one runs on the parked worker thread
(engine/cpu_worker.py) while the calling thread runs the other. That pays only since OpenBLAS's
own workers sleep right after a GEMM (engine/platform.py OPENBLAS_THREAD_TIMEOUT): before, one
of them spun on the second core through the attention (a split measured no gain then).

The runner takes this path on the CPU with float32 pages where `KernelChoices.cpu_decode` is on
(`StepBatch.cpu_decode`), for one-token rows without attention sinks; sliding-window layers
pass each row's first visible key.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from engine import cpu_worker
from engine.cpu_worker import nogil_kernel

# Rows from which a call is split across the calling thread and the parked worker (below it,
# the hand-off costs more than half the work saves). SPLIT = False keeps every call on the
# calling thread (benches compare).
SPLIT_MIN_ROWS = 4
SPLIT = True


@functools.cache
def _kernel():
    """The compiled kernel, built (or loaded from Numba's cache) on first use."""
    return nogil_kernel(_attend, "CPU decode kernel")


def _attend(q, k_pages, v_pages, pages, lo, hi, page_tokens, scale, out):  # pragma: no cover
    """out[b, h] = softmax(scale * q[b, h] . K_b[lo_b:hi_b]) V_b[lo_b:hi_b] for every row b
    and query head h, where K_b / V_b are row b's keys and values in page-table order
    (`pages[b, j // page_tokens]`, slot j % page_tokens). q [B, Hq, D], pages [KVH, N, T, D]."""
    rows, q_heads, dim = q.shape
    kv_heads = k_pages.shape[0]
    dv = v_pages.shape[3]
    group = q_heads // kv_heads
    for item in range(rows * kv_heads):
        b = item // kv_heads
        h = item % kv_heads
        first, end = lo[b], hi[b]
        qh = q[b, h * group:(h + 1) * group]
        scores = np.empty((group, end - first), np.float32)
        for j in range(first, end):
            key = k_pages[h, pages[b, j // page_tokens], j % page_tokens]
            for r in range(group):
                acc = np.float32(0.0)
                for c in range(dim):
                    acc += qh[r, c] * key[c]
                scores[r, j - first] = acc * scale
        totals = np.empty(group, np.float32)
        for r in range(group):
            top = scores[r, 0]
            for j in range(1, end - first):
                top = max(top, scores[r, j])
            total = np.float32(0.0)
            for j in range(end - first):
                e = np.exp(scores[r, j] - top)
                scores[r, j] = e
                total += e
            totals[r] = total
        acc_v = np.zeros((group, dv), np.float32)
        for j in range(first, end):
            value = v_pages[h, pages[b, j // page_tokens], j % page_tokens]
            for r in range(group):
                p = scores[r, j - first]
                for c in range(dv):
                    acc_v[r, c] += p * value[c]
        for r in range(group):
            inv = np.float32(1.0) / totals[r]
            for c in range(dv):
                out[b, h * group + r, c] = acc_v[r, c] * inv


def decode_attention(q: mx.array, k_pages: mx.array, v_pages: mx.array, pages: np.ndarray,
                     lo: np.ndarray, hi: np.ndarray, scale: float) -> mx.array:
    """Attention of one query token per row, q [B, Hq, 1, D] (float32), over head-major pages
    k_pages [KVH, N, T, D] / v_pages [KVH, N, T, Dv]: row b attends to keys lo[b]..hi[b]-1 of
    its page list `pages[b]` (positions relative to its first listed page). Returns
    [B, Hq, 1, Dv] float32. The pages must already hold this step's keys: they are evaluated
    here (the layer's write is in their graph)."""
    mx.eval(q, k_pages, v_pages)
    b, hq, _, d = q.shape
    qn = np.ascontiguousarray(np.asarray(q).reshape(b, hq, d))
    out = np.empty((b, hq, v_pages.shape[-1]), np.float32)
    kernel = _kernel()
    kp, vp, t, sc = np.asarray(k_pages), np.asarray(v_pages), k_pages.shape[2], np.float32(scale)

    def run(a, z):   # rows a..z-1
        kernel(qn[a:z], kp, vp, pages[a:z], lo[a:z], hi[a:z], t, sc, out[a:z])
    cpu_worker.in_two(run, row_split(hi - lo), b)
    return mx.array(out)[:, :, None]


def row_split(keys: np.ndarray) -> int:
    """Where a call of these rows (keys read per row) is cut between the calling thread and
    the parked worker: the row that halves the keys read; 0 (not cut) below SPLIT_MIN_ROWS
    rows or with SPLIT off. Each row is computed as unsplit (bit-identical)."""
    if not SPLIT or len(keys) < SPLIT_MIN_ROWS:
        return 0
    total = np.cumsum(keys)
    return int(np.clip(np.searchsorted(total, total[-1] / 2), 1, len(keys) - 1))


def row_bounds(view_base: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
               window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Each decode row's visible keys relative to its view's first page: [lo, hi). The row
    sees positions up to its own token (start + length - 1); a sliding window of w keys starts
    at start + length - w (as StepBatch's mask: key > query - w)."""
    ends = starts + lengths
    lo = np.zeros_like(ends) if window is None else np.maximum(ends - window, 0) - view_base
    return lo.astype(np.int64), (ends - view_base).astype(np.int64)
