"""Prefill over packed history in bounded tiles under one online softmax (the direct path's
long-chunk case; engine.attention.packed.direct_attention calls it).

The chunk's own keys go first (`fresh_full`, or on the CPU `fresh_causal_blocks`), then
`tiled_history` unpacks the packed history tile by tile into BLAS matmuls. Everything is FP32;
nothing the size of the whole history is materialized. Shapes: queries grouped per KV head,
(B, Hkv, rep, L, D); fresh k/v (B, Hkv, 1, L, D); packed history (B, Hkv, S, ...).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx

from capacity.formats import KVFormat
from engine.kv.page_quant import PagePacked, dequantize_pages
from engine.kv.quant import Packed, PackedKV, dequantize

# On the CPU, causal prefill scores the chunk's own keys this many queries at a time (see
# fresh_causal_blocks); shorter chunks take one block. Not on GPUs: there the tiled path is
# bound by kernel launches, not by exp, and the blocks add launches (unmeasured there).
CAUSAL_BLOCK_CPU = 128


class _Online(NamedTuple):
    """Online-softmax state over query rows (B, Hkv, rep*L): running max, sum and output."""

    m: mx.array
    denom: mx.array
    acc: mx.array


def fresh_full(qn, k_new, v_new, nmask) -> _Online:
    """The chunk's own keys in one block, under any mask (every query sees its own key).
    The keys may include native sink rows ahead of the chunk's own (K >= L keys)."""
    B, Hkv, rep, L, D = qn.shape
    K = k_new.shape[-2]
    s = qn @ k_new.swapaxes(-1, -2)                       # (B, Hkv, rep, L, K)
    s = (s if nmask is None else mx.where(nmask, s, -mx.inf)).reshape(B, Hkv, rep * L, K)
    m = s.max(axis=-1, keepdims=True)
    p = _exp_shifted(s, m)
    return _Online(m, p.sum(axis=-1, keepdims=True), p @ v_new.reshape(B, Hkv, K, -1))


def fresh_causal_blocks(qn, k_new, v_new, block: int) -> _Online:
    """The chunk's own keys under the causal rule, `block` queries at a time.

    Query block i only scores keys [0, end of block i): the fully masked upper-right blocks are
    never computed, which removes about 3/8 of the chunk's own exps at 4 blocks (native SDPA on
    the CPU computes and masks them). Exp is most of attention's time on the CPU.
    """
    B, Hkv, rep, L, D = qn.shape
    ms, sums, accs = [], [], []
    for a in range(0, L, block):
        b = min(L, a + block)
        s = qn[..., a:b, :] @ k_new[..., :b, :].swapaxes(-1, -2)     # (B, Hkv, rep, b-a, b)
        diag = mx.arange(a, b)[:, None] >= mx.arange(b)[None]
        s = mx.where(diag, s, -mx.inf)
        m = s.max(axis=-1, keepdims=True)
        p = _exp_shifted(s, m)
        ms.append(m)
        sums.append(p.sum(axis=-1, keepdims=True))
        accs.append(p @ v_new[..., :b, :])
    rows = (B, Hkv, rep * L)
    return _Online(*(mx.concatenate(x, axis=3).reshape(*rows, x[0].shape[-1])
                     for x in (ms, sums, accs)))


def tiled_history(qh, state: _Online, hist: PackedKV, hmask, fmt: KVFormat, sinks, tile: int):
    """Prefill over packed history: unpack `tile` rows at a time, one online softmax.

    `state` already holds the chunk's own keys (every query sees at least its own key, so the
    running max is finite from the start); each history tile is dequantized into a bounded FP32
    scratch, used by a BLAS matmul and dropped. Nothing the size of the whole history is ever
    materialized. Scores are (B, Hkv, rep*L, T): one GEMM per KV head for all its query heads,
    not a matmul broadcast over a repeat axis. Page-key history (engine.kv.page_quant) is unpacked
    whole pages at a time (the tile rounded up to pages).
    """
    B, Hkv, rep, L, D = qh.shape
    rows = (B, Hkv, rep * L)
    q_flat = qh.reshape(*rows, D)
    m, denom, acc = state
    pages = isinstance(hist.k, PagePacked)
    if pages and tile % hist.k.page_tokens:   # page keys unpack whole pages per tile
        tile = -(-tile // hist.k.page_tokens) * hist.k.page_tokens
    for start in range(0, hist.length, tile):
        cut = lambda pk: Packed(*(a[..., start:start + tile, :] for a in pk))  # noqa: E731
        kt = (dequantize_pages(hist.k, fmt.k_bits, start, start + tile) if pages
              else dequantize(cut(hist.k), fmt.k_bits))
        vt = dequantize(cut(hist.v), fmt.v_bits)
        vt = mx.concatenate([vt, mx.ones((*vt.shape[:-1], 1), vt.dtype)], axis=-1)
        s = q_flat @ kt.swapaxes(-1, -2)
        if hmask is not None:
            n = kt.shape[-2]
            s = mx.where(hmask[..., start:start + tile], s.reshape(B, Hkv, rep, L, n),
                         -mx.inf).reshape(*rows, n)
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        c, p = mx.exp(m - m_new), _exp_shifted(s, m_new)
        pv = p @ vt
        denom = denom * c + pv[..., D:]
        acc = acc * c + pv[..., :D]
        m = m_new
    if sinks is not None:   # a sink adds probability mass but no value
        sink = mx.repeat(sinks.astype(mx.float32).reshape(1, Hkv, rep, 1), L, axis=3)
        sink = sink.reshape(1, Hkv, rep * L, 1)
        m_new = mx.maximum(m, sink)
        c = mx.exp(m - m_new)
        denom = denom * c + mx.exp(sink - m_new)
        acc = acc * c
    return acc / denom


def _exp_plain(s, m):
    return mx.exp(s - m)


@lru_cache(maxsize=None)
def _exp_kernel():
    """exp(s - m) as one fused elementwise kernel (mx.compile), or the plain two-op form.

    On the CPU the score tile's exp is most of attention's time and a separate subtract pass
    streams the whole tile through memory once more; fusing removes that pass. Compiling on the
    CPU needs a C++ compiler at run time: if compiling fails we keep the plain form (same math).
    """
    fused = mx.compile(_exp_plain, shapeless=True)
    try:
        probe = mx.array([[0.0, -1.0, -mx.inf]])
        mx.eval(fused(probe, mx.zeros((1, 1))))
        return fused
    except Exception:  # noqa: BLE001 - no JIT toolchain: the plain ops compute the same values
        return _exp_plain


def _exp_shifted(s, m):
    return _exp_kernel()(s, m)
