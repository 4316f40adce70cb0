"""Attention on the CPU with the softmax done by NumPy on MLX's own buffer.

MLX's CPU backend has no vector math on x86: `exp` (and so `softmax`, `sigmoid`) runs one
element at a time through a polynomial whose fused multiply-adds are libm calls, an order of
magnitude slower than `np.exp`, and it made attention most of a CPU prefill
(bench/cpu_profile.py; the numbers: docs/lab/engine-kernel-notes.md). So the score and value
products stay MLX GEMMs (OpenBLAS), and only the softmax between them runs in NumPy, in place on
the evaluated score array (MLX arrays expose their buffer to NumPy without a copy; the array is
this function's own fresh result, so no other array sees the write).

`prefill_attention` serves multi-token rows; paged decode (engine/attention/paged.py) calls
`softmax_in_place` on its page-wise scores. Packed formats take both where the runner's step
says so (engine/attention/packed.py: a prompt's first chunk, decode rows' scores). Prefill
queries are taken in blocks of rows: a causal block reads keys only up to its last query, so
the masked upper triangle is neither multiplied nor exponentiated, and the scores never exceed
SCORE_ELEMENTS per block.

The price: the graph is evaluated up to each layer's attention while the step is being built,
so a pipelined decode step no longer builds while the previous one computes. On the CPU that
build is small next to the softmax time it saves (docs/lab/engine-kernel-notes.md).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

# Masked scores: float32's lowest finite value, as mlx-lm does (exp underflows to exactly 0).
_LOWEST = np.float32(np.finfo(np.float32).min)

# The most scores one block materialises (32 MiB of float32).
SCORE_ELEMENTS = 1 << 23
# Query rows per causal block: small enough that skipping the upper triangle pays, large
# enough that the GEMMs stay efficient and the per-block Python cost stays small.
CAUSAL_BLOCK = 128


def softmax_in_place(scores: mx.array) -> mx.array:
    """Softmax over the last axis of `scores` (float32, a fresh result only the caller holds),
    computed by NumPy into the array's own buffer; returns `scores`, now evaluated."""
    a = _exp_in_place(scores)
    a *= 1.0 / a.sum(axis=-1, keepdims=True)
    return scores


def _exp_in_place(scores: mx.array) -> np.ndarray:
    """exp(scores - row max) into `scores`' own buffer (as `softmax_in_place`); the NumPy view."""
    mx.eval(scores)
    a = np.asarray(scores)
    a -= a.max(axis=-1, keepdims=True)
    np.exp(a, out=a)
    return a


def prefill_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                      mask: mx.array | str | None) -> mx.array:
    """mx.fast.scaled_dot_product_attention's result for float32 q [B, Hq, L, D] against
    k [B, Hkv, S, D], v [B, Hkv, S, Dv]; `mask`: None, "causal" (bottom-right aligned, as
    MLX's) or a boolean array broadcastable to [B, 1, L, S]."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    # The g query heads of a KV head go through one GEMM as g*rows rows: the broadcast form
    # ([B, Hkv, g, rows, S] against [B, Hkv, 1, S, Dv]) measured 5x slower for the PV product.
    q = (q * scale).reshape(B, Hkv, g, L, D)
    kt = k.swapaxes(-1, -2)                              # [B, Hkv, D, S]
    causal = isinstance(mask, str)
    rows = max(1, SCORE_ELEMENTS // (B * Hq * S))
    if causal:
        rows = min(rows, CAUSAL_BLOCK)
    keep = None if mask is None or causal else mask[:, :, None]   # [B, 1, 1, L, S]
    outs = []
    for lo in range(0, L, rows):
        hi = min(lo + rows, L)
        end = S - L + hi if causal else S               # keys the block's last query sees
        n = hi - lo
        s = (q[:, :, :, lo:hi].reshape(B, Hkv, g * n, D) @ kt[..., :end]
             ).reshape(B, Hkv, g, n, end)
        if keep is not None:
            s = mx.where(keep[..., lo:hi, :], s, _LOWEST)
        elif causal:
            # Query lo+i sits at key position S-L+lo+i: keys after it are the block's upper
            # triangle over its last hi-lo key columns.
            s = _mask_upper(s, n)
        # Unnormalised weights times V, then divided by each row's sum: the division runs
        # over Dv outputs per row instead of `end` weights (one pass over the scores less).
        total = mx.array(_exp_in_place(s).sum(axis=-1, keepdims=True))
        out = (s.reshape(B, Hkv, g * n, end) @ v[..., :end, :]).reshape(B, Hkv, g, n, -1)
        outs.append(out / total)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, Hq, L, v.shape[-1])


def _mask_upper(s: mx.array, n: int) -> mx.array:
    """Scores with key column end-n+j hidden from query row i where j > i."""
    mx.eval(s)
    a = np.asarray(s)
    np.copyto(a[..., a.shape[-1] - n:], _LOWEST, where=_upper(n))
    return s


_UPPER: dict[int, np.ndarray] = {}


def _upper(n: int) -> np.ndarray:
    if n not in _UPPER:
        _UPPER[n] = np.triu(np.ones((n, n), dtype=bool), k=1)
    return _UPPER[n]
