"""Decode attention over page-key history with MLX's own quantized matmuls (every backend).

Page keys (engine.kv.page_quant) are code[t, c] * scale[p, c] + offset[p, c]: one FP32 scale and
offset per channel per page. Folding each page's scales into the query (page_scores' identity)

    score[r, t] = sum_c (q[r, c] * scale[p, c]) * code[t, c] + sum_c q[r, c] * offset[p, c]

leaves a plain matmul of the scaled query against the raw codes. The codes are stored as
MLX packs them (page_quant._pack: 4 codes per 32 bits little-end first for 4 bits, 4 codes in 3
bytes for 6), so `mx.quantized_matmul(x, codes, ones, zeros, transpose=True)` computes that
matmul with MLX's kernels on Metal, CUDA and the CPU, one batch entry per (sequence, page):
unit scales and zero biases make MLX's dequantization the identity on the codes. The
group size is then free (it only says how many unit scales there are), so every page size works,
16-token pages included; the per-channel, per-page grouping lives in the folded query.
Why not quantized_matmul(q, K^T, scale, offset, transpose=False) with group = page size: that
needs codes packed along tokens (not how pages store them) and page size >= 32 (MLX's smallest
group); and MLX's CUDA backend serves transpose=False only with its generic kernel.

Values are token-local (per-token groups of 64 channels with FP32 scale and offset), which is
MLX's own affine layout: p @ V is quantized_matmul(p, V, transpose=False), as
engine.attention.packed does for token-local formats.

Exactness: the activations are float32 (ACTIVATION), so MLX takes the FP32 metadata as stored;
with bf16 activations MLX's CUDA kernels want the scales and offsets in bf16 too
(engine.attention.packed._qmm casts them), 8 mantissa bits, a new error no identity names: so
bf16 (KernelChoices.page_key_qmm_bf16, tensor cores on CUDA) is off by default.

What MLX 0.32's CUDA quantized kernels assume (qmm_naive, qmv): batch entry i of the weights,
scales and biases starts i matrices into the array, whatever its strides, so each operand must
be one contiguous block per entry. `scores` and `values` put every KV head of a page (or a
chunk of tokens) in one matrix, which is exactly how the store's gathered buffer lies (token-
major, heads interleaved), so they read it without a reordering copy; what is still copied is
that gather itself (the page pool keeps all six sections of a page together,
engine.kv.page_layout, so a section's pages are not one contiguous block each). Reading pages in
place needs each section in its own array (`PageExperts`; `expert_attention` runs that shape
with gather_qmm and bench.device.page_key_qmm times it against a gathered copy).
"""
from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from engine.attention.choices import KernelChoices
from engine.kv.page_quant import PagePacked
from engine.kv.quant import Packed, group_of

# Activation dtype of the quantized matmuls: float32 keeps the formats' FP32 metadata exact.
ACTIVATION = mx.float32
# Most matrices one quantized matmul call may batch: MLX's CUDA kernels launch one grid z-slice
# per batch entry, and CUDA caps gridDim.z at 65,535 (32K tokens x 8 sequences x 4 KV heads in
# 16-token pages is 65,536 entries).
MAX_ENTRIES = 65535


# Most tokens of value history per batch entry of the values' matmul (`values`).
VALUE_CHUNK = 256


def page_slices(lead: int, pages: int) -> list[slice]:
    """Slices of `pages` such that lead * (pages in a slice) <= MAX_ENTRIES."""
    step = max(1, MAX_ENTRIES // max(1, lead))
    return [slice(i, min(i + step, pages)) for i in range(0, pages, step)]


def enabled(kernels: KernelChoices) -> bool:
    """Whether decode steps over page-key history take this path (KernelChoices.page_key_qmm:
    None means on GPUs, where the alternative is the tiled dequantize path)."""
    choice = kernels.page_key_qmm
    return mx.default_device() != mx.cpu if choice is None else choice


def activation(kernels: KernelChoices) -> mx.Dtype:
    """The matmuls' activation dtype (KernelChoices.page_key_qmm_bf16; see the module doc)."""
    return mx.bfloat16 if kernels.page_key_qmm_bf16 else ACTIVATION


def key_group(head_dim: int) -> int:
    """The (unit-scale) group size MLX is told for codes of one key row: any legal size that
    divides head_dim; the largest, so the unit scales are fewest."""
    for g in (128, 64, 32):
        if head_dim % g == 0:
            return g
    raise ValueError(f"head_dim {head_dim} is not a multiple of 32 (MLX's smallest group)")


def _identity_meta(shape: tuple, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    # Full-size, contiguous: MLX's CUDA kernels read metadata at a fixed per-entry stride.
    return mx.ones(shape, dtype), mx.zeros(shape, dtype)


def fold_scores(x: mx.array, codes: mx.array, bits: int, dtype: mx.Dtype = ACTIVATION):
    """Scaled queries x (..., M, D) against raw codes (..., N, D*bits/32): (..., M, N). The codes
    are copied whole unless already one contiguous block (MLX's CUDA kernels step batch entries
    by one matrix's size whatever the strides, so a strided view would read the wrong rows)."""
    d = x.shape[-1]
    g = key_group(d)
    ones, zeros = _identity_meta((*codes.shape[:-1], d // g), dtype)
    return mx.quantized_matmul(x.astype(dtype), mx.contiguous(codes), ones, zeros,
                               transpose=True, group_size=g, bits=bits)


def _own_heads(a: mx.array, first: int, second: int) -> mx.array:
    """The entries of `a` where its two KV-head axes agree, axis `second` dropped: each query
    head's product with its own KV head's columns."""
    h = a.shape[first]
    shape = [1] * a.ndim
    shape[first] = shape[second] = h
    return (a * mx.eye(h, dtype=a.dtype).reshape(shape)).sum(axis=second)


def _page_major(a: mx.array) -> mx.array:
    """(B, H, S, ...) history -> (B, S, H, ...): the store gathers pages token-major and hands
    attention a transposed view, so this is the gathered buffer itself, no copy."""
    return a.swapaxes(1, 2)


def scores(rows: mx.array, keys: PagePacked, bits: int, dtype: mx.Dtype = ACTIVATION):
    """rows (B, Hkv, R, D) against page-key history of P whole pages: (B, Hkv, R, P*T) float32.

    One batch entry per (sequence, page), every KV head in it: rows are the H*R query heads
    (each scaled by its own KV head's page scales), columns the page's T*H stored key rows as
    they lie in the gathered buffer (token-major, heads interleaved), so the codes need no
    reordering copy; each query head keeps its own KV head's columns (`_own_heads`). MLX's CUDA
    kernel computes whole 16-64 x 128 tiles, so up to T*H = 128 columns cost what one head's T
    columns would, with H times fewer batch entries."""
    B, H, R, D = rows.shape
    P, T = keys.scales.shape[-2], keys.page_tokens
    rows = rows.astype(mx.float32)
    x = mx.expand_dims(rows, 2) * mx.expand_dims(keys.scales, 3)            # (B, H, P, R, D)
    x = x.transpose(0, 2, 1, 3, 4).reshape(B, P, H * R, D)
    codes = _page_major(keys.codes).reshape(B, P, T * H, -1)                 # rows (t, h)
    raw = mx.concatenate([fold_scores(x[:, sl], codes[:, sl], bits, dtype)
                          for sl in page_slices(B, P)], axis=1)             # (B, P, H*R, T*H)
    raw = _own_heads(raw.astype(mx.float32).reshape(B, P, H, R, T, H), 2, 5)  # (B,P,H,R,T)
    shift = keys.offsets @ rows.swapaxes(-1, -2)                             # (B, H, P, R)
    s = raw.transpose(0, 2, 3, 1, 4) + mx.expand_dims(shift.swapaxes(-1, -2), -1)
    return s.reshape(B, H, R, P * T)


def _chunk_tokens(S: int, chunk: int) -> int:
    """The largest divisor of S that is at most `chunk`: whole chunks, no remainder call."""
    return max(n for n in range(1, min(S, chunk) + 1) if S % n == 0)


def values(p: mx.array, v: Packed, bits: int, dtype: mx.Dtype = ACTIVATION,
           chunk: int | None = None) -> mx.array:
    """p (B, Hkv, R, S) @ token-local packed values (B, Hkv, S, ...): (B, Hkv, R, D) float32.

    The history is cut into chunks of up to `chunk` tokens, one batch entry each, and their
    partial sums added: MLX's CUDA kernel for transpose=False runs one thread block per (row
    tile, column tile, batch entry) and walks the contraction inside it, so one entry per
    sequence would leave most of the GPU idle on long histories. As in `scores`, every KV head
    is in one matrix (rows: the H*R query heads; columns: the H*D values of a token as the
    gathered buffer holds them, no copy) and each query head keeps its own head's columns."""
    B, H, R, S = p.shape
    n = _chunk_tokens(S, chunk or VALUE_CHUNK)
    c = S // n
    x = p.reshape(B, H * R, c, n).swapaxes(1, 2)                             # (B, c, H*R, n)
    w, sc, of = (_page_major(a).reshape(B, c, n, -1).astype(t)
                 for a, t in ((v.codes, v.codes.dtype), (v.scales, dtype), (v.offsets, dtype)))
    out = 0
    for sl in page_slices(B, c):
        part = mx.quantized_matmul(x[:, sl].astype(dtype), *(mx.contiguous(a[:, sl])
                                                           for a in (w, sc, of)),
                                   transpose=False, group_size=group_of(v, bits), bits=bits)
        out = out + part.astype(mx.float32).sum(axis=1)                      # (B, H*R, H*D)
    return _own_heads(out.reshape(B, H, R, H, -1), 1, 3)                     # (B, H, R, D)


class PageExperts(NamedTuple):
    """Page-key pages with each section in its own array, one contiguous block per page (the
    stored page layout, token-major with KV heads interleaved, minus the other sections): the
    pool shape gather_qmm could read in place. kc (N, T, Hkv, D*kb/32) key codes, ks / ko
    (N, Hkv, D) per-channel key scale / offset, vc (N, T, Hkv, D*vb/32) value codes, vs / vo
    (N, T, Hkv, D/64)."""

    kc: mx.array
    ks: mx.array
    ko: mx.array
    vc: mx.array
    vs: mx.array
    vo: mx.array
    k1: mx.array   # unit scales and zero biases of kc (N, T*Hkv, D/key_group): MLX's identity
    k0: mx.array   # dequantization, built once with the pool (`page_experts`)


def page_experts(kc, ks, ko, vc, vs, vo) -> PageExperts:
    """A PageExperts pool from its arrays, with the unit metadata its key codes need."""
    n, t, h, _ = kc.shape
    d = ks.shape[-1]
    kc, ks, ko, vc, vs, vo = (mx.contiguous(a) for a in (kc, ks, ko, vc, vs, vo))
    return PageExperts(kc, ks, ko, vc, vs, vo,
                       *_identity_meta((n, t * h, d // key_group(d)), ACTIVATION))


def expert_attention(q: mx.array, pool: PageExperts, tables: mx.array, k_bits: int,
                     v_bits: int, scale: float, v_group: int = 64) -> mx.array:
    """Decode attention of q (B, Hq, D) over whole pages `tables` (B, P) of `pool`, read in
    place by gather_qmm (no copy of the codes; every KV head of a page in one matmul, as in
    `scores`): (B, Hq, D) float32. History only (no fresh rows, every page visible): the part
    of a decode step the store layout decides."""
    B, Hq, D = q.shape
    N, T, H, _ = pool.kc.shape
    P, R = tables.shape[1], Hq // H
    tables = tables.astype(mx.int32)
    rows = q.astype(mx.float32).reshape(B, H, R, D) * scale
    ks, ko = pool.ks[tables], pool.ko[tables]                                # (B, P, H, D)
    x = (mx.expand_dims(rows, 1) * mx.expand_dims(ks, 3)).reshape(B, P, H * R, D)
    kc, vc = pool.kc.reshape(N, T * H, -1), pool.vc.reshape(N, T, -1)       # views, no copy
    vs, vo = pool.vs.reshape(N, T, -1), pool.vo.reshape(N, T, -1)
    slices = page_slices(B, P)
    raw = mx.concatenate([
        mx.gather_qmm(x[:, sl].astype(ACTIVATION), kc, pool.k1, pool.k0,
                      rhs_indices=tables[:, sl], transpose=True, group_size=key_group(D),
                      bits=k_bits)
        for sl in slices], axis=1)                                           # (B, P, H*R, T*H)
    raw = _own_heads(raw.reshape(B, P, H, R, T, H), 2, 5)                   # (B, P, H, R, T)
    shift = (mx.expand_dims(ko, 3) * mx.expand_dims(rows, 1)).sum(-1)       # (B, P, H, R)
    s = (raw + mx.expand_dims(shift, -1)).transpose(0, 2, 3, 1, 4).reshape(B, H, R, P * T)
    p = mx.softmax(s, axis=-1, precise=True).reshape(B, H * R, P, T).swapaxes(1, 2)
    out = sum(mx.gather_qmm(p[:, sl].astype(ACTIVATION), vc, vs, vo, rhs_indices=tables[:, sl],
                            transpose=False, group_size=v_group, bits=v_bits).sum(axis=1)
              for sl in slices)                                              # (B, H*R, H*D)
    return _own_heads(out.reshape(B, H, R, H, D), 1, 3).reshape(B, Hq, D)
