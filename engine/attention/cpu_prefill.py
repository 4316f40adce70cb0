"""Prefill attention on the CPU straight from float32 pages, in one compiled loop (Numba).

Why (issue 30): a prompt's chunk attended through MLX GEMMs over a gathered copy of its keys,
with the softmax in NumPy between them (engine/attention/cpu_softmax.py). That took 21 % of a
served CPU prefill step of SmolLM2 (a 400-token prompt with 16 decode rows: 214 of 1,012 ms),
and far more where a call holds a chunk with history or rows of different lengths: the mask is
then an array, every block computes its whole rectangle of scores and MLX selects the masked
ones one element at a time (a 248-token chunk after 200 tokens of history with a second row
beside it: 532 of 1,494 ms). The GEMMs' inner dimension is the head's 64 channels, where BLAS
is far from its peak, and NumPy's exp ran on one core while the other idled.

Here one kernel walks each row's page table itself, as the decode kernel (cpu_decode.py) does:
per (row, KV head) it copies the keys the row's queries can see into a transposed scratch
([dim, keys], so the score loop runs along keys in SIMD lanes with no horizontal sums) and
their values into a contiguous one, then
per query and head: scores over exactly the keys that query sees (causal by position, a sliding
window's start, nothing past the row's last real token), a max, an exp, a sum and the weighted
values. No gather, no mask, no padding computed (a padded query's
output is zero: nothing reads it). The exp is a range-reduced degree-7 polynomial (`_fast_exp`,
relative error ~1e-7 like float32's own rounding) because Numba's `np.exp` is a scalar libm
call that would not vectorise.

A call with enough work is cut in two at the query that halves its key reads: the calling
thread takes the first part and the parked worker (engine/cpu_worker.py, the decode kernel's
too) the second; every query is computed as unsplit (bit-identical). The kernel is `nogil`, keeps
no state and is cached beside this file by Numba (`cache=True`), compiled in a replica's
warm-up. The runner takes it on the CPU with float32 pages where `KernelChoices.cpu_prefill`
is on, for multi-token rows without attention sinks.
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from engine import cpu_worker

# A call is split across the calling thread and the parked worker from this many key reads
# (query-key pairs per head): below it the hand-off costs more than half the work saves.
SPLIT_MIN_PAIRS = 1 << 11
SPLIT = True

# exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, Cody-Waite).
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)


def _fast_exp(x):  # pragma: no cover - compiled
    """exp(x) for float32 x <= 0 (scores minus their max): |r| <= ln2/2, so the Taylor terms
    to r^7 leave ~5e-9 relative error; below -87 the result underflows to ~0 as exp's."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.0 / 5040)
    p = p * r + np.float32(1.0 / 720)
    p = p * r + np.float32(1.0 / 120)
    p = p * r + np.float32(1.0 / 24)
    p = p * r + np.float32(1.0 / 6)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    # 2^n by its float32 bits: n + 127 in the exponent field.
    return p * np.int32((np.int32(n) + np.int32(127)) << 23).view(np.float32)


def _attend(q, k_pages, v_pages, pages, starts, base, lengths, window, page_tokens, scale,
            out, q0, q1):  # pragma: no cover - compiled
    """out[b, :, i] = attention of query i of row b (absolute position starts[b] + i) over the
    keys it sees: positions max(0, pos + 1 - window) (window > 0) .. pos, found in page-table
    order from position base[b] (`pages[b, (p - base[b]) // page_tokens]`). Queries q0..q1-1
    only; padded ones (i >= lengths[b]) get zeros. q [B, Hq, L, D], pages [KVH, N, T, D]."""
    rows, q_heads, width, dim = q.shape
    kv_heads = k_pages.shape[0]
    dv = v_pages.shape[3]
    group = q_heads // kv_heads
    T = page_tokens
    acc = np.empty(dv, np.float32)
    for b in range(rows):
        real = min(q1, lengths[b])
        for i in range(max(real, q0), q1):
            for hq in range(q_heads):
                for c in range(dv):
                    out[b, hq, i, c] = 0.0
        if real <= q0:
            continue
        # Keys any query of this range sees, relative to the row's view: [lo, hi).
        hi = starts[b] + real - base[b]
        lo = 0 if window <= 0 else max(starts[b] + q0 + 1 - window, 0) - base[b]
        nk = hi - lo
        kt = np.empty((dim, nk), np.float32)
        vs = np.empty((nk, dv), np.float32)
        s = np.empty(nk, np.float32)
        for h in range(kv_heads):
            for j in range(nk):
                p = lo + j
                key = k_pages[h, pages[b, p // T], p % T]
                for c in range(dim):
                    kt[c, j] = key[c]
                value = v_pages[h, pages[b, p // T], p % T]
                for c in range(dv):
                    vs[j, c] = value[c]
            for i in range(q0, real):
                pos = starts[b] + i
                end = pos + 1 - base[b] - lo
                first = 0 if window <= 0 else max(pos + 1 - window, 0) - base[b] - lo
                n = end - first
                for r in range(group):
                    qh = q[b, h * group + r, i]
                    # Sliced 1-D views: loops from 0 over contiguous memory vectorise.
                    ss = s[first:end]
                    for j in range(n):
                        ss[j] = 0.0
                    for c in range(0, dim - 7, 8):   # eight channels per pass over the scores
                        a0, a1 = qh[c] * scale, qh[c + 1] * scale
                        a2, a3 = qh[c + 2] * scale, qh[c + 3] * scale
                        a4, a5 = qh[c + 4] * scale, qh[c + 5] * scale
                        a6, a7 = qh[c + 6] * scale, qh[c + 7] * scale
                        k0, k1 = kt[c, first:end], kt[c + 1, first:end]
                        k2, k3 = kt[c + 2, first:end], kt[c + 3, first:end]
                        k4, k5 = kt[c + 4, first:end], kt[c + 5, first:end]
                        k6, k7 = kt[c + 6, first:end], kt[c + 7, first:end]
                        for j in range(n):
                            ss[j] += (a0 * k0[j] + a1 * k1[j] + a2 * k2[j] + a3 * k3[j]
                                      + a4 * k4[j] + a5 * k5[j] + a6 * k6[j] + a7 * k7[j])
                    for c in range(dim - dim % 8, dim):
                        a0 = qh[c] * scale
                        k0 = kt[c, first:end]
                        for j in range(n):
                            ss[j] += a0 * k0[j]
                    top = ss[0]
                    for j in range(1, n):
                        top = max(top, ss[j])
                    total = np.float32(0.0)
                    for j in range(n):
                        e = _fast_exp(ss[j] - top)
                        ss[j] = e
                        total += e
                    for c in range(dv):
                        acc[c] = 0.0
                    for j in range(0, n - 3, 4):   # four value rows per pass over the output
                        p0, p1, p2, p3 = ss[j], ss[j + 1], ss[j + 2], ss[j + 3]
                        r0, r1 = vs[first + j], vs[first + j + 1]
                        r2, r3 = vs[first + j + 2], vs[first + j + 3]
                        for c in range(dv):
                            acc[c] += p0 * r0[c] + p1 * r1[c] + p2 * r2[c] + p3 * r3[c]
                    for j in range(n - n % 4, n):
                        r0 = vs[first + j]
                        p0 = ss[j]
                        for c in range(dv):
                            acc[c] += p0 * r0[c]
                    inv = np.float32(1.0) / total
                    o = out[b, h * group + r, i]
                    for c in range(dv):
                        o[c] = acc[c] * inv


@functools.cache
def _kernel():
    """The compiled kernel, built (or loaded from Numba's cache) on first use: `_fast_exp`
    becomes an inlined Numba function first, so the kernel's calls compile to it."""
    global _fast_exp
    numba = cpu_worker.import_numba("CPU prefill kernel")
    _fast_exp = numba.njit(fastmath=True, nogil=True, cache=True, inline="always")(_fast_exp)
    return cpu_worker.nogil_kernel(_attend, "CPU prefill kernel")


def split_point(starts: np.ndarray, base: np.ndarray, lengths: np.ndarray, width: int,
                window: int | None) -> int:
    """The query index that halves the call's key reads (0: do not split): every row's queries
    below it on one thread, the rest on the other."""
    i = np.arange(width)
    keys = (starts[:, None] + i[None, :] + 1 - base[:, None]).astype(np.int64)
    if window is not None:
        keys = np.minimum(keys, window)
    keys = np.where(i[None, :] < lengths[:, None], keys, 0).sum(axis=0)
    total = int(keys.sum())
    if total < SPLIT_MIN_PAIRS:
        return 0
    m = int(np.searchsorted(np.cumsum(keys), total / 2))
    return m if 0 < m < width else 0


def prefill_attention(q: mx.array, k_pages: mx.array, v_pages: mx.array, pages: np.ndarray,
                      starts: np.ndarray, base: np.ndarray, lengths: np.ndarray,
                      window: int | None, scale: float) -> mx.array:
    """Attention of multi-token rows, q [B, Hq, L, D] float32 (row b's query i at position
    starts[b] + i; i >= lengths[b] is padding), over head-major pages k_pages [KVH, N, T, D] /
    v_pages [KVH, N, T, Dv] listed per row from position base[b] (`pages[b]`), causal and
    within `window` keys where given. Returns [B, Hq, L, Dv] float32. The pages must hold this
    call's keys: they are evaluated here (the layer's write is in their graph)."""
    mx.eval(q, k_pages, v_pages)
    b, hq, width, _ = q.shape
    qn = np.ascontiguousarray(np.asarray(q))
    out = np.empty((b, hq, width, v_pages.shape[-1]), np.float32)
    kernel = _kernel()
    args = (np.asarray(k_pages), np.asarray(v_pages), np.ascontiguousarray(pages, np.int64),
            np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(base, np.int64),
            np.ascontiguousarray(lengths, np.int64), int(window or 0), k_pages.shape[2],
            np.float32(scale), out)
    m = split_point(starts, base, lengths, width, window) if SPLIT else 0
    if m:
        half = cpu_worker.parked_worker().submit(kernel, qn, *args, m, width)
        kernel(qn, *args, 0, m)
        half.result()
    else:
        kernel(qn, *args, 0, width)
    return mx.array(out)
