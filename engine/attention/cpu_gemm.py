"""Decode scores against packed keys on the CPU as one BLAS GEMM on the integer codes.

MLX's CPU `quantized_matmul` with transpose=True (q against packed key rows) is a scalar loop,
several times slower than a float32 GEMM of the same scores, and `dequantize` is slower than
converting the same codes to float32 (measured: docs/lab/engine-kernel-notes.md). So the affine
math is taken out of the inner product:

    score[r, s] = sum_g scale[s, g] * (q_g[r] . c_g[s]) + offset[s, g] * sum(q_g[r])

with c the codes as float32 and g the groups of 64 channels. All groups go through one GEMM
against a block-diagonal query matrix (D x G*R), then the per-group scales and the offset term
(rows x S x groups, small) finish it. FP32 throughout: equal to the dequantized math up to
rounding. The float32 codes are a bounded scratch (SCRATCH_ELEMENTS): long histories are scored
slice by slice.

The value side stays on quantized_matmul: without the transpose MLX's CPU kernel is already
faster than the GEMM form of it.
"""
from __future__ import annotations

import mlx.core as mx

from capacity.formats import GROUP_SIZE
from engine.kv.quant import Packed, group_of


def code_planes(p: Packed, bits: int) -> list[tuple[mx.array, slice]]:
    """The codes as float32 planes, each with the channels it holds: int8 one plane (..., S, D);
    int4 the low nibbles (even channels) and the high nibbles (odd channels), (..., S, D/2) each,
    so no interleaving copy is needed (the queries are split the same way instead)."""
    # Codes are packed little-end-first into uint32 words, so on a little-endian host the bytes
    # of a word are its codes in order (int8), or channel pairs low nibble first (int4).
    u = mx.contiguous(p.codes).view(mx.uint8)
    if bits == 8:
        return [(u.astype(mx.float32), slice(None))]
    if bits == 4:
        return [((u & 0xF).astype(mx.float32), slice(0, None, 2)),
                ((u >> 4).astype(mx.float32), slice(1, None, 2))]
    raise ValueError(f"bits must be 4 or 8, got {bits}")


# The float32 codes are a scratch of B*Hkv*rows*D elements; history is scored in slices of rows
# so it never exceeds this (16 MiB), whatever the context: the direct path's promise is no
# float32 copy of the whole history (a long packed context is the point of packing).
SCRATCH_ELEMENTS = 1 << 22


def scores(rows: mx.array, p: Packed, bits: int, scratch_elements: int = SCRATCH_ELEMENTS
           ) -> mx.array:
    """rows (B, Hkv, R, D) float32 against packed keys (B, Hkv, S): (B, Hkv, R, S)."""
    B, H, R, D = rows.shape
    S = p.codes.shape[-2]
    step = max(GROUP_SIZE, scratch_elements // (B * H * D))
    if S <= step:
        return _scores(rows, p, bits)
    return mx.concatenate([_scores(rows, Packed(*(a[..., i:i + step, :] for a in p)), bits)
                           for i in range(0, S, step)], axis=-1)


def _scores(rows: mx.array, p: Packed, bits: int) -> mx.array:
    B, H, R, D = rows.shape
    size = group_of(p, bits)       # channels per group (64; int4-k32 keys: 32)
    g = D // size
    q = rows.reshape(B, H, R, g, size).transpose(0, 1, 3, 4, 2)           # (B, H, G, size, R)
    eye = mx.eye(g, dtype=rows.dtype)
    block = (mx.expand_dims(q, 4) * eye[:, None, :, None]).reshape(B, H, D, g * R)
    raw = sum(plane @ block[:, :, channels, :] for plane, channels in code_planes(p, bits))
    raw = raw.reshape(B, H, -1, g, R)                                     # (B, H, S, G, R)
    scaled = (raw * mx.expand_dims(p.scales, -1)).sum(axis=3)             # (B, H, S, R)
    return (scaled + p.offsets @ q.sum(axis=3)).swapaxes(-1, -2)
