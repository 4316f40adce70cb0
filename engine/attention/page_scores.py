"""Decode scores against page-key history (engine.kv.page_quant) as matmuls on the codes.

A page-key key is code[t, c] * scale[p, c] + offset[p, c], one scale and offset per channel per
page. Folding the scales into the query, per page, takes the affine math out of the inner product:

    score[r, t] = sum_c (q[r, c] * scale[p, c]) * code[t, c] + sum_c q[r, c] * offset[p, c]

so a decode step converts the codes to float32 (bit operations) and runs one small matmul per
page against that page's scaled queries, instead of dequantizing every key (multiply and add per
value) and then scoring it, as the tiled path does. The codes are unpacked into planes of
channels with the same bit position (6-bit codes: 4 codes in 3 bytes, channels c::4), and the
queries are split the same way, so no interleaving copy is made. MLX ops only, so any backend can
take it (no custom kernel). The float32 planes are a bounded scratch: long histories are scored
some pages at a time (cpu_gemm.SCRATCH_ELEMENTS).
"""
from __future__ import annotations

import mlx.core as mx

from engine.attention.cpu_gemm import SCRATCH_ELEMENTS
from engine.kv.page_quant import PagePacked


def code_planes(codes: mx.array, bits: int) -> list[tuple[mx.array, slice]]:
    """(float32 plane (..., S, D/k), the channels it holds) for codes (..., S, W) uint32."""
    u = mx.contiguous(codes).view(mx.uint8)
    if bits == 8:
        return [(u.astype(mx.float32), slice(None))]
    if bits == 4:
        return [((u & 0xF).astype(mx.float32), slice(0, None, 2)),
                ((u >> 4).astype(mx.float32), slice(1, None, 2))]
    if bits == 6:   # code i of 4 at bits 6i..6i+5 of 3 little-end-first bytes (page_quant._pack)
        b = u.reshape(*u.shape[:-1], -1, 3)
        b0, b1, b2 = b[..., 0], b[..., 1], b[..., 2]
        planes = (b0 & 63, (b0 >> 6) | ((b1 & 15) << 2), (b1 >> 4) | ((b2 & 3) << 4), b2 >> 2)
        return [(p.astype(mx.float32), slice(i, None, 4)) for i, p in enumerate(planes)]
    raise ValueError(f"bits must be 4, 6 or 8, got {bits}")


def page_scores(rows: mx.array, keys: PagePacked, bits: int,
                scratch_elements: int = SCRATCH_ELEMENTS) -> mx.array:
    """rows (B, Hkv, R, D) float32 against page-key history of P whole pages: (B, Hkv, R, P*T)."""
    B, H, R, D = rows.shape
    P, T = keys.scales.shape[-2], keys.page_tokens
    step = max(1, scratch_elements // (B * H * T * D))   # pages per slice
    if P <= step:
        return _scores(rows, keys, bits)
    return mx.concatenate(
        [_scores(rows, PagePacked(keys.codes[..., i * T:(i + step) * T, :],
                                  keys.scales[..., i:i + step, :],
                                  keys.offsets[..., i:i + step, :]), bits)
         for i in range(0, P, step)], axis=-1)


def _scores(rows: mx.array, keys: PagePacked, bits: int) -> mx.array:
    B, H, R, D = rows.shape
    P, T = keys.scales.shape[-2], keys.page_tokens
    # Each page's queries with its channel scales folded in: (B, H, P, D, R).
    scaled = mx.expand_dims(rows.swapaxes(-1, -2), 2) * mx.expand_dims(keys.scales, -1)
    raw = None
    for plane, channels in code_planes(keys.codes, bits):
        part = plane.reshape(B, H, P, T, -1) @ scaled[:, :, :, channels, :]   # (B, H, P, T, R)
        raw = part if raw is None else raw + part
    shift = keys.offsets @ rows.swapaxes(-1, -2)                             # (B, H, P, R)
    return (raw + mx.expand_dims(shift, 3)).reshape(B, H, P * T, R).swapaxes(-1, -2)
