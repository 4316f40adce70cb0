"""Token-local affine quantization of K/V rows: groups of 64 channels, FP32 scale and FP32 offset.

value ~= code * scale + offset, with offset = group min and scale = (max - min) / (2^bits - 1), so
every value is reconstructed within scale / 2. Codes are packed little-end-first into uint32 words,
the layout `mx.dequantize` and `mx.quantized_matmul` read, so attention can consume packed pages
directly. We compute scale/offset ourselves instead of calling `mx.quantize`: MLX's affine mode
shifts the grid to make zero exact, which roughly doubles the worst-case error for no RMS gain
(docs/lab/engine-notes.md), and it stores metadata in the input dtype (bf16 on GPU).

A row's byte layout (checkpoints, byte accounting) is codes | FP32 scales | FP32 offsets.
Groups are 64 channels unless a format says otherwise (int4-k32 keys: 32); a Packed carries its
own group size in its shapes (channels / metadata columns), so readers infer it (`group_of`).
"""
from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from capacity.formats import GROUP_SIZE, packed_row_bytes


class Packed(NamedTuple):
    """Packed rows: codes (..., D*bits/32) uint32, scales and offsets (..., D/64) float32."""

    codes: mx.array
    scales: mx.array
    offsets: mx.array


class PackedKV(NamedTuple):
    """Gathered packed history of one layer: keys (rotated basis) and values."""

    k: Packed
    v: Packed

    @property
    def length(self) -> int:
        return self.k.codes.shape[-2]


def quantize(x: mx.array, bits: int, group: int = GROUP_SIZE) -> Packed:
    """Quantize the last axis of x (its length a multiple of `group`) in float32."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group not in (32, 64):
        raise ValueError(f"group must be 32 or 64, got {group}")
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"last axis {d} is not a multiple of {group}")
    lead = x.shape[:-1]
    g = x.astype(mx.float32).reshape(*lead, d // group, group)
    q, scale, lo = affine_codes(g, bits, axis=-1)
    codes = pack_codes(q.reshape(*lead, d), bits)
    return Packed(codes, scale.squeeze(-1), lo.squeeze(-1))


def affine_codes(x: mx.array, bits: int, axis: int) -> tuple[mx.array, mx.array, mx.array]:
    """Min/max affine codes of float32 `x` over `axis` (one grid per slice along it):
    (uint32 codes shaped like x, scale, offset), scale and offset keeping `axis` as size 1."""
    lo = x.min(axis=axis, keepdims=True)
    scale = (x.max(axis=axis, keepdims=True) - lo) / (2**bits - 1)
    # A constant group has scale 0: every code is 0 and the offset alone is exact.
    safe = mx.where(scale > 0, scale, 1.0)
    q = mx.clip(mx.round((x - lo) / safe), 0, 2**bits - 1).astype(mx.uint32)
    return q, scale, lo


def pack_codes(q: mx.array, bits: int) -> mx.array:
    """uint32 codes (..., D) of 4 or 8 bits -> words (..., D*bits/32), little-end first."""
    per_word = 32 // bits
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per_word, per_word)
    return (q << mx.arange(0, 32, bits, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def group_of(p: Packed, bits: int) -> int:
    """Channels per group of packed rows: their channel count over their metadata columns."""
    return p.codes.shape[-1] * (32 // bits) // p.scales.shape[-1]


def dequantize(p: Packed, bits: int, dtype=mx.float32) -> mx.array:
    return mx.dequantize(p.codes, p.scales, p.offsets, group_size=group_of(p, bits),
                         bits=bits).astype(dtype)


def row_bytes(head_dim: int, bits: int, group: int = GROUP_SIZE) -> int:
    return packed_row_bytes(head_dim, bits, group)


def to_row_bytes(p: Packed) -> mx.array:
    """(..., row_bytes) uint8 in the documented layout: codes | scales | offsets (little-endian)."""
    parts = [a.view(mx.uint8) for a in (p.codes, p.scales, p.offsets)]
    return mx.concatenate(parts, axis=-1)


def from_row_bytes(rows: mx.array, head_dim: int, bits: int, group: int = GROUP_SIZE) -> Packed:
    """Inverse of to_row_bytes: bit-exact, no arithmetic on the values."""
    if rows.dtype != mx.uint8 or rows.shape[-1] != row_bytes(head_dim, bits, group):
        raise ValueError(f"expected uint8 rows of {row_bytes(head_dim, bits, group)} bytes, "
                         f"got {rows.dtype} {rows.shape}")
    nc = head_dim * bits // 8
    ng = head_dim // group * 4
    codes = rows[..., :nc].view(mx.uint32)
    scales = rows[..., nc:nc + ng].view(mx.float32)
    offsets = rows[..., nc + ng:].view(mx.float32)
    return Packed(codes, scales, offsets)
