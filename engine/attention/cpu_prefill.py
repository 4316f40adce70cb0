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

Page-key layers (k6v4-kivi, int4-kivi) take the same kernel with another loader
(`page_key_prefill_attention`): a row's keys and values below its last full page are
dequantized into the scratches from their codes where they lie in the pool (per-channel key
scale and offset per page, per-group values: engine/kv/page_quant.py, quant.py; the byte
parts of cpu_page_key_decode.py), the partial page's come from the row's native tail slot as
the step began, then the call's own, in full precision: the MLX direct path's semantics,
without its gathered history, masks and tiles (which made a page-key prompt step ~1.4x
native's once native's took this kernel).

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
from engine.attention import cpu_page_key_decode

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


def _head_queries(q, out, b, h, group, kt, vs, s, acc, origin, q0, q1, start, window,
                  scale):  # pragma: no cover - compiled (inlined into the kernels)
    """Queries q0..q1-1 of row b (query i at position start + i) for the query heads of KV head
    h, over the keys loaded for them: kt [dim, keys] transposed, vs [keys, dv], key j at
    position origin + j. Each query sees exactly positions max(0, pos + 1 - window) (window >
    0) .. pos: no mask, no padding."""
    dim = kt.shape[0]
    dv = vs.shape[1]
    for i in range(q0, q1):
        pos = start + i
        end = pos + 1 - origin
        first = 0 if window <= 0 else max(pos + 1 - window, 0) - origin
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


def _zero_padding(out, b, real, q0, q1):  # pragma: no cover - compiled (inlined)
    """Row b's padded queries in q0..q1-1 (from `real`) get zeros: nothing reads them."""
    for i in range(max(real, q0), q1):
        for hq in range(out.shape[1]):
            for c in range(out.shape[3]):
                out[b, hq, i, c] = 0.0


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
        _zero_padding(out, b, real, q0, q1)
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
            _head_queries(q, out, b, h, group, kt, vs, s, acc, base[b] + lo, q0, real,
                          starts[b], window, scale)


def _split_row(codes, page, first, split, chans, into):  # pragma: no cover - compiled (inlined)
    """Codes of one packed row (pool page `page`, from byte `first`) added into `into` by
    channel (zeroed by the caller): each byte's low and high parts at their weights
    (cpu_page_key_decode.byte_parts)."""
    for k in range(split.shape[1]):
        x = np.float32(codes[page, first + np.uint64(k)])
        hi = np.floor(x * split[0, k])
        into[chans[0, k]] += (x - split[1, k] * hi) * split[2, k]
        into[chans[1, k]] += hi


def _attend_page_keys(q, k_new, v_new, codes, meta, tail_k, tail_v, pages, starts, slots,
                      lengths, k_split, k_chans, v_split, v_chans, k_word, at, page_tokens,
                      scale, out, q0, q1):  # pragma: no cover - compiled
    """As `_attend` (causal, no window, base 0) over a page-key layer: row b's keys and values
    at positions below starts[b] // T * T dequantized from its full pages' codes, those up to
    starts[b] from its native tail slot `slots[b]` as the step began, then the call's own
    k_new / v_new [B, Hkv, L, D]. codes / meta, tail_k / tail_v, k_split .. at: as
    cpu_page_key_decode._attend takes them."""
    rows, q_heads, width, dim = q.shape
    kv_heads = k_new.shape[1]
    group = q_heads // kv_heads
    T = page_tokens
    kb, vb = k_split.shape[1], v_split.shape[1]   # code bytes of a key row, of a value row
    v_groups = dim // 64
    kc_at, vc_at, ks_at, ko_at, vs_at, vo_at = at[0], at[1], at[2], at[3], at[4], at[5]
    acc = np.empty(dim, np.float32)
    code = np.empty(dim, np.float32)
    k_scale = np.empty(dim, np.float32)
    k_offset = np.empty(dim, np.float32)
    for b in range(rows):
        real = min(q1, lengths[b])
        _zero_padding(out, b, real, q0, q1)
        if real <= q0:
            continue
        start = starts[b]
        full = start // T
        nk = start + real
        kt = np.empty((dim, nk), np.float32)
        vs = np.empty((nk, dim), np.float32)
        s = np.empty(nk, np.float32)
        for h in range(kv_heads):
            for j in range(full):
                page = pages[b, j]
                for c in range(dim):
                    k_scale[c] = meta[page, ks_at + k_word[h, 0, c]]
                    k_offset[c] = meta[page, ko_at + k_word[h, 0, c]]
                for i in range(T):
                    p = j * T + i
                    row = i * kv_heads + h
                    code[:] = 0.0
                    _split_row(codes, page, np.uint64(4 * kc_at + row * kb), k_split, k_chans,
                               code)
                    for c in range(dim):
                        kt[c, p] = code[c] * k_scale[c] + k_offset[c]
                    value = vs[p]
                    value[:] = 0.0
                    _split_row(codes, page, np.uint64(4 * vc_at + row * vb), v_split, v_chans,
                               value)
                    for g in range(v_groups):
                        sc = meta[page, vs_at + row * v_groups + g]
                        off = meta[page, vo_at + row * v_groups + g]
                        for c in range(g * 64, g * 64 + 64):
                            value[c] = value[c] * sc + off
            for p in range(full * T, nk):
                if p < start:
                    key, val = tail_k[slots[b], p - full * T, h], tail_v[slots[b], p - full * T, h]
                else:
                    key, val = k_new[b, h, p - start], v_new[b, h, p - start]
                for c in range(dim):
                    kt[c, p] = key[c]
                    vs[p, c] = val[c]
            _head_queries(q, out, b, h, group, kt, vs, s, acc, 0, q0, real, start, 0, scale)


@functools.cache
def _helpers() -> None:
    """The kernels' helpers as inlined Numba functions, put in this module's globals before a
    kernel compiles so its calls compile to them."""
    numba = cpu_worker.import_numba("CPU prefill kernel")
    inline = numba.njit(fastmath=True, nogil=True, cache=True, inline="always")
    for name in ("_fast_exp", "_head_queries", "_zero_padding", "_split_row"):
        globals()[name] = inline(globals()[name])


@functools.cache
def _kernel():
    """The compiled kernel over float32 pages, built (or loaded from Numba's cache) on first
    use."""
    _helpers()
    return cpu_worker.nogil_kernel(_attend, "CPU prefill kernel")


@functools.cache
def _page_key_kernel():
    """The compiled kernel over page-key pages."""
    _helpers()
    return cpu_worker.nogil_kernel(_attend_page_keys, "CPU page-key prefill kernel")


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
    cpu_worker.in_two(lambda q0, q1: kernel(qn, *args, q0, q1), m, width)
    return mx.array(out)


def page_key_prefill_attention(store, step, view, queries: mx.array, keys: mx.array,
                               values: mx.array, scale: float,
                               tail_slots: mx.array) -> mx.array:
    """Attention of multi-token rows, queries [B, Hq, L, D], over a page-key store's history
    as the step began (full pages from their codes, each row's partial page from its native
    tail slot `tail_slots[b]`) and the call's own keys / values [B, Hkv, L, D], causal. Writes
    the step's tail rows after (`store.flush_tail`). Returns [B, Hq, L, D] in queries' dtype."""
    b, hq, width, d = queries.shape
    q, kn, vn, tk, tv = (x if x.dtype == mx.float32 else x.astype(mx.float32)
                         for x in (queries, keys, values, *store.tail))
    mx.eval(q, kn, vn, store.pool, tk, tv, tail_slots)   # the pool's graph holds this step's writes
    k_word, at = cpu_page_key_decode.layout_words(store.layout, store.fmt.k_bits, d)
    words = np.asarray(store.pool)
    out = np.empty((b, hq, width, d), np.float32)
    starts = np.ascontiguousarray(step.starts, np.int64)
    lengths = np.ascontiguousarray(step.lengths, np.int64)
    args = (np.ascontiguousarray(np.asarray(kn)), np.ascontiguousarray(np.asarray(vn)),
            words.view(np.uint8), words.view(np.float32), np.ascontiguousarray(np.asarray(tk)),
            np.ascontiguousarray(np.asarray(tv)),
            np.ascontiguousarray(view.pages_np, np.int64), starts,
            np.ascontiguousarray(np.asarray(tail_slots), np.int64), lengths,
            *cpu_page_key_decode.byte_parts(store.fmt.k_bits, d),
            *cpu_page_key_decode.byte_parts(store.fmt.v_bits, d), k_word, at,
            store.page_tokens, np.float32(scale), out)
    qn = np.ascontiguousarray(np.asarray(q))
    kernel = _page_key_kernel()
    m = split_point(starts, np.zeros_like(starts), lengths, width, None) if SPLIT else 0
    cpu_worker.in_two(lambda q0, q1: kernel(qn, *args, q0, q1), m, width)
    del words, args   # no NumPy view may outlive the call: the next write updates the pool in place
    store.flush_tail()   # this step's new tail rows, after the old tails were read
    return mx.array(out).astype(queries.dtype)
