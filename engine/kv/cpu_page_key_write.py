"""A page-key store's write arithmetic on the CPU in compiled loops (Numba): value records and
the key codes of the pages a write fills, byte for byte what the MLX ops compute.

Why: on the CPU every MLX op of a write is its own pass over memory on one core. A 400-token
k6v4-kivi prompt chunk's write took ~3 ms per layer (native's: ~0.4), most of it in the ops
that quantize: values per 64-channel group (engine/kv/quant.py: min, max, scale, round, pack,
then a concatenation into records) ~0.45 ms, and the filled pages' keys per channel
(engine/kv/page_quant.py) ~1.3 ms, of which ~0.55 ms only built the pages (the tail slot's
rows gathered, the write's rows scattered in). Here each is one loop over the rows; the
scatters into the pool stay MLX's (`PageLayout.write_rows` / `write_pages`), so the pool is
only ever written through MLX's graph.

Exactness: the same float32 operations in the same order as `quant.affine_codes` (min, max,
(max - min) / (2^bits - 1), (x - min) / scale rounded half to even, clipped), compiled
without fast-math (which could turn the divisions into reciprocal products), and the same
little-end-first packing (6-bit codes four to three bytes: page_quant._pack). Tests compare
the bytes with the MLX write's.

The store takes these on the CPU with float32 tails where `KernelChoices.cpu_page_key_write`
is on (engine/kv/page_key_store.py).
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from engine.cpu_worker import import_numba


def _pack_into(q, bits, out, at):  # pragma: no cover - compiled (inlined)
    """Codes q [D] (float32 integers) into bytes out[at:at + D * bits / 8], little end first."""
    d = q.shape[0]
    if bits == 8:
        for c in range(d):
            out[at + c] = np.uint8(q[c])
    elif bits == 4:
        for c in range(0, d, 2):
            out[at + c // 2] = np.uint8(np.uint32(q[c]) | (np.uint32(q[c + 1]) << 4))
    else:   # 6: four codes to three bytes
        for c in range(0, d, 4):
            v = (np.uint32(q[c]) | (np.uint32(q[c + 1]) << 6) | (np.uint32(q[c + 2]) << 12)
                 | (np.uint32(q[c + 3]) << 18))
            b = at + c // 4 * 3
            out[b] = np.uint8(v & 255)
            out[b + 1] = np.uint8((v >> 8) & 255)
            out[b + 2] = np.uint8((v >> 16) & 255)


def _affine(x, levels, q):  # pragma: no cover - compiled (inlined)
    """quant.affine_codes over x [n]: codes into q, returns (scale, offset)."""
    lo = x[0]
    hi = x[0]
    for i in range(1, x.shape[0]):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
    scale = (hi - lo) / np.float32(levels)
    safe = scale if scale > 0 else np.float32(1.0)
    for i in range(x.shape[0]):
        q[i] = min(max(np.rint((x[i] - lo) / safe), np.float32(0.0)), np.float32(levels))
    return scale, lo


def _value_records(v, bits, group, codes, scales, offsets):  # pragma: no cover - compiled
    """v [N, H, D] float32 -> codes [N, H, D * bits / 8] bytes, scales / offsets [N, H, D /
    group] float32 (engine.kv.quant.quantize)."""
    n, heads, d = v.shape
    levels = 2 ** bits - 1
    q = np.empty(group, np.float32)
    for r in range(n):
        for h in range(heads):
            for g in range(d // group):
                s, o = _affine(v[r, h, g * group:(g + 1) * group], levels, q)
                scales[r, h, g] = s
                offsets[r, h, g] = o
                _pack_into(q, bits, codes[r, h], g * group * bits // 8)


def _page_keys(tail_k, sources, where, offsets_in, rows, k, bits, codes, scales,
               offsets):  # pragma: no cover - compiled
    """The filled pages' keys: page f = tail slot sources[f]'s rows with the write's rows
    k[rows[i]] at (where[i], offsets_in[i]); quantized per channel over its T tokens
    (page_quant.quantize_pages). codes [F, T, H, D * bits / 8] bytes; scales / offsets [F, T,
    H, D / T]: the stored metadata rows (page_quant.meta_rows: token t carries channels
    t * D/T .. (t + 1) * D/T - 1)."""
    fills = sources.shape[0]
    t, heads, d = tail_k.shape[1], tail_k.shape[2], tail_k.shape[3]
    per = d // t
    levels = 2 ** bits - 1
    page = np.empty((t, heads, d), np.float32)
    col = np.empty(t, np.float32)
    q = np.empty((t, d), np.float32)
    qc = np.empty(t, np.float32)
    for f in range(fills):
        page[:] = tail_k[sources[f]]
        for i in range(rows.shape[0]):
            if where[i] == f:
                page[offsets_in[i]] = k[rows[i]]
        for h in range(heads):
            for c in range(d):
                for j in range(t):
                    col[j] = page[j, h, c]
                s, o = _affine(col, levels, qc)
                for j in range(t):
                    q[j, c] = qc[j]
                scales[f, c // per, h, c % per] = s
                offsets[f, c // per, h, c % per] = o
            for j in range(t):
                _pack_into(q[j], bits, codes[f, j, h], 0)


@functools.cache
def _kernels():
    """(value records, page keys), compiled on first use (cached beside this file); no
    fast-math: the divisions must stay divisions."""
    numba = import_numba("CPU page-key write")
    inline = numba.njit(cache=True, nogil=True, inline="always")
    global _pack_into, _affine
    _pack_into, _affine = inline(_pack_into), inline(_affine)
    jit = numba.njit(cache=True, nogil=True)
    return jit(_value_records), jit(_page_keys)


def value_record_parts(v: mx.array, bits: int, group: int) -> list[mx.array]:
    """quant.quantize(v, bits, group) as its three parts (codes [N, H, D * bits / 32] uint32,
    scales and offsets [N, H, D / group] float32), for page_layout.record."""
    x = np.ascontiguousarray(np.asarray(v.astype(mx.float32) if v.dtype != mx.float32 else v))
    n, h, d = x.shape
    codes = np.empty((n, h, d * bits // 8), np.uint8)
    scales = np.empty((n, h, d // group), np.float32)
    offsets = np.empty((n, h, d // group), np.float32)
    _kernels()[0](x, bits, group, codes, scales, offsets)
    return [mx.array(codes.view(np.uint32)), mx.array(scales), mx.array(offsets)]


def filled_page_keys(tail_k: mx.array, sources: np.ndarray, where: np.ndarray,
                     offsets: np.ndarray, rows: np.ndarray, k: mx.array,
                     bits: int) -> list[mx.array]:
    """The key sections of F filled pages (K_SECTIONS order, each [F, T, H, width] as
    PageLayout.write_pages takes them): codes uint32, scale rows and offset rows float32."""
    tk = np.asarray(tail_k)
    kn = np.ascontiguousarray(np.asarray(k.astype(mx.float32) if k.dtype != mx.float32 else k))
    f, (_, t, h, d) = len(sources), tk.shape
    codes = np.empty((f, t, h, d * bits // 8), np.uint8)
    scales = np.empty((f, t, h, d // t), np.float32)
    offs = np.empty((f, t, h, d // t), np.float32)
    _kernels()[1](tk, sources, where, offsets, rows, kn, bits, codes, scales, offs)
    return [mx.array(codes.view(np.uint32)), mx.array(scales), mx.array(offs)]
