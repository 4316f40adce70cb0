"""Keys quantized per channel over a whole page (KIVI-style; capacity.formats `int4-kivi`).

value ~= code * scale[channel] + offset[channel], one FP32 scale and offset per channel per page
per KV head, from the page's min and max of that channel over its tokens: the per-channel grid
keeps a key channel with a large range (keys have a few) from widening every other channel's
steps, which is what per-token groups suffer and why they are rotated first. Codes are packed
little-end-first into uint32 words along the channels, as engine.kv.quant packs them.

Storage keeps the metadata in token rows (`meta_rows`): token j of a page carries channels
j*D/T..(j+1)*D/T-1 of the page's scales and offsets, so a stored key row has exactly the shape of
a token-local row with group T (engine.kv.quant.Packed; checkpoints move it verbatim).
Attention gathers history as `PagePacked` (per-page metadata) and unpacks it tile by tile
(`dequantize_pages`).
"""
from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from engine.kv.quant import affine_codes, pack_codes


class PagePacked(NamedTuple):
    """Gathered page-key history: codes (..., P*T, D*bits/32) uint32, one row per token (whole
    pages), scales and offsets (..., P, D) float32, one per channel per page."""

    codes: mx.array
    scales: mx.array
    offsets: mx.array

    @property
    def page_tokens(self) -> int:
        return self.codes.shape[-2] // self.scales.shape[-2]


def _pack(q: mx.array, bits: int) -> mx.array:
    """uint32 codes (..., D) -> words (..., D*bits/32), little-end first (engine.kv.quant's).
    6-bit codes go 4 to 3 bytes (little-end first: code i of a group at bits 6i..6i+5), the
    bytes in order; the row is still whole uint32 words when D is a multiple of 16."""
    if bits == 6:
        q = q.reshape(*q.shape[:-1], q.shape[-1] // 4, 4)
        v = (q << mx.array([0, 6, 12, 18], dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)
        b = (mx.expand_dims(v, -1) >> mx.array([0, 8, 16], dtype=mx.uint32)) & 255
        b = b.astype(mx.uint8).reshape(*q.shape[:-2], -1)
        return b.view(mx.uint32)
    return pack_codes(q, bits)


def unpack_codes(words: mx.array, bits: int) -> mx.array:
    """Words (..., W) -> the codes as float32 (..., W*32/bits)."""
    if bits == 6:
        b = words.view(mx.uint8).astype(mx.uint32)
        b = b.reshape(*words.shape[:-1], -1, 3)
        v = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        q = (mx.expand_dims(v, -1) >> mx.array([0, 6, 12, 18], dtype=mx.uint32)) & 63
        return q.reshape(*words.shape[:-1], -1).astype(mx.float32)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = (mx.expand_dims(words, -1) >> shifts) & (2 ** bits - 1)
    return q.reshape(*words.shape[:-1], -1).astype(mx.float32)


def quantize_pages(x: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize whole pages x (..., T, D) per channel over the T axis, in float32.

    Returns codes (..., T, D*bits/32) uint32 and scales, offsets (..., D) float32.
    """
    q, scale, lo = affine_codes(x.astype(mx.float32), bits, axis=-2)
    return _pack(q, bits), scale.squeeze(-2), lo.squeeze(-2)


def dequantize_pages(p: PagePacked, bits: int, start: int = 0, stop: int | None = None) -> mx.array:
    """float32 keys (..., stop-start, D) of rows [start, stop); both on page boundaries (or stop
    at the end)."""
    t = p.page_tokens
    stop = p.codes.shape[-2] if stop is None else min(stop, p.codes.shape[-2])
    if start % t or stop % t:
        raise ValueError(f"page-key rows [{start}, {stop}) do not fall on pages of {t}")
    q = unpack_codes(p.codes[..., start:stop, :], bits)
    lead, d = q.shape[:-2], q.shape[-1]
    pages = (stop - start) // t
    q = q.reshape(*lead, pages, t, d)
    scales = mx.expand_dims(p.scales[..., start // t:stop // t, :], -2)
    offsets = mx.expand_dims(p.offsets[..., start // t:stop // t, :], -2)
    return (q * scales + offsets).reshape(*lead, pages * t, d)


def meta_rows(meta: mx.array, page_tokens: int) -> mx.array:
    """Per-page metadata (N, H, D) -> the row layout (N, T, H, D/T) the store keeps."""
    n, h, d = meta.shape
    return meta.reshape(n, h, page_tokens, d // page_tokens).transpose(0, 2, 1, 3)


def meta_pages(rows: mx.array) -> mx.array:
    """Stored rows of B x P pages (B, P, T, H, D/T) -> per-page metadata (B, H, P, D)."""
    b, p, t, h, g = rows.shape
    return rows.transpose(0, 3, 1, 2, 4).reshape(b, h, p, t * g)
