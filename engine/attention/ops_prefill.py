"""Multi-token attention as plain MLX ops (two matmuls and a softmax), for backends whose fast
SDPA pays a build per shape.

On CUDA, `mx.fast.scaled_dot_product_attention` sends every multi-row call (bf16/fp16, head
dim <= 128) to cuDNN, and MLX keeps cuDNN's execution plans in an LRU keyed on the exact query,
key and mask shapes. A served prefill step has a new (queries, keys) pair almost every time
(prompt lengths and histories differ), so it builds a plan almost every step: tens of ms of
host time, whatever the step's length. These ops have no plan to build (cuBLAS matmuls and
MLX's own softmax kernel), so a new shape costs what its arithmetic costs. The score matrix is
materialised, which is why `use_ops` keeps long calls on the fast path (flash attention keeps
its memory linear).
"""
from __future__ import annotations

import mlx.core as mx

# The most scores ([B, Hq, L, S] elements) one call materialises through ops: 64 Mi elements,
# 256 MiB in float32. Longer calls take mx.fast's SDPA, whose plan build is then a small share
# of the call.
OPS_SCORE_ELEMENTS = 1 << 26


def use_ops(q: mx.array, k: mx.array, limit: int | None = None) -> bool:
    """Whether a multi-token call of q [B, Hq, L, D] against k [B, Hkv, S, D] stays under the
    score budget of the ops path (`limit`, default OPS_SCORE_ELEMENTS)."""
    b, hq, n, _ = q.shape
    limit = OPS_SCORE_ELEMENTS if limit is None else limit
    return n > 1 and b * hq * n * k.shape[2] <= limit


def ops_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                  mask: mx.array | str | None, score_dtype=mx.float32) -> mx.array:
    """mx.fast.scaled_dot_product_attention's result for q [B, Hq, L, D] against k [B, Hkv, S,
    D], v [B, Hkv, S, Dv]; `mask`: None, "causal" (bottom-right aligned, as MLX's) or a boolean
    array broadcastable to [B, 1, L, S]. The query heads of one KV head go through one matmul
    as group*L rows (no repeated K/V). `score_dtype`: the dtype of scores and softmax (float32;
    bench.prefill_scores passes q's dtype to measure what float32 costs and buys)."""
    b, hq, n, d = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    g = hq // hkv
    # Scores and softmax in float32, as flash attention keeps them (cuDNN's SDPA, which mlx-lm's
    # prefill takes on CUDA): bf16 scores round each logit to 8 significant bits before the
    # softmax, an error the fast path does not make. The weights go back to V's dtype for the
    # second matmul (flash attention's P is bf16 there too). bf16 values are exact in float32
    # (and in TF32), so only the accumulation and the stored scores change.
    qg = (q.astype(score_dtype) * mx.array(scale, dtype=score_dtype)).reshape(b, hkv, g * n, d)
    scores = (qg @ k.astype(score_dtype).swapaxes(-1, -2)).reshape(b, hkv, g, n, s_len)
    if isinstance(mask, str):
        q_pos = mx.arange(s_len - n, s_len)[:, None]
        mask = (mx.arange(s_len)[None, :] <= q_pos)[None, None]       # [1, 1, L, S]
    if mask is not None:
        keep = mask if mask.ndim == 5 else mask[:, :, None]             # [B, 1, 1, L, S]
        scores = mx.where(keep, scores, mx.finfo(score_dtype).min)
    probs = mx.softmax(scores, axis=-1, precise=True).astype(v.dtype)
    out = probs.reshape(b, hkv, g * n, s_len) @ v
    return out.reshape(b, hq, n, v.shape[-1])
