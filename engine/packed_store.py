"""Packed paged layer store: K/V rows kept as affine codes + FP32 scales + FP32 offsets.

Implements engine.kvstore's per-layer store protocol (page_bytes, nbytes, write, gather, arrays)
so KVStore can hold packed and native layers side by side. Keys are rotated (engine.rotation)
before they are quantized; values are not. Pages are token-major like the native store,
[num_pages, page_tokens, kv_heads, words], so a write is one scatter per array and a gather is
one take plus a free reshape.

Attention does not use `gather` (that returns dequantized, un-rotated rows for tools and tests);
it reads `gather_packed` through engine.packed_cache, and checkpoints move rows with
`read_packed`/`write_packed`, which never requantize.
"""
from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from capacity.formats import KVFormat, KVFormatError
from engine import cuda_packed_write
from engine.kvstore import NativeLayerStore, Slots
from engine.model import LayerGeometry
from engine.packed_attention import PackedAttention, PackedKV
from engine.packed_cache import PackedLayerCache
from engine.quant import Packed, dequantize, quantize
from engine.rotation import rotate, rotation_matrix


def _zeros(num_pages, page_tokens, heads, dim, bits):
    groups = dim // 64
    return Packed(mx.zeros((num_pages, page_tokens, heads, dim * bits // 32), mx.uint32),
                  mx.zeros((num_pages, page_tokens, heads, groups), mx.float32),
                  mx.zeros((num_pages, page_tokens, heads, groups), mx.float32))


class PackedLayerStore:
    """One full-attention layer's pages in a packed format."""

    packed = True
    cache_class = PackedLayerCache   # the runner builds this cache for packed layers

    def __init__(self, geometry: LayerGeometry, fmt: KVFormat, num_pages: int, page_tokens: int,
                 attention: Optional[PackedAttention] = None):
        if geometry.kind != "full":
            raise KVFormatError(f"layer {geometry.index} is {geometry.kind}; only full-attention "
                                "layers are packed")
        if geometry.v_head_dim != geometry.head_dim:
            raise KVFormatError(f"layer {geometry.index}: packed KV needs equal K and V head dims")
        if fmt.head_dim != geometry.head_dim:
            raise KVFormatError(f"format bound to head_dim {fmt.head_dim}, layer has "
                                f"{geometry.head_dim}")
        self.geometry = geometry
        self.fmt = fmt
        self.page_tokens = page_tokens
        self.attention = attention or PackedAttention(fmt)
        h, d = geometry.kv_heads, geometry.head_dim
        self.k = _zeros(num_pages, page_tokens, h, d, fmt.k_bits)
        self.v = _zeros(num_pages, page_tokens, h, d, fmt.v_bits)
        mx.eval(*self.arrays())
        self.nbytes = sum(a.nbytes for a in self.arrays())
        self.page_bytes = self.nbytes // num_pages

    def write(self, slots: Slots, k: mx.array, v: mx.array) -> None:
        """Quantize N new rows ([N, heads, dim], keys after RoPE) into their slots."""
        if cuda_packed_write.usable(self.fmt.k_bits, self.fmt.v_bits, self.geometry.head_dim):
            # CUDA: the same rotation and quantization in one kernel launch (not ~40 ops).
            self.write_packed(slots, *cuda_packed_write.quantize_kv(
                k, v, self.fmt.k_bits, self.fmt.v_bits))
            return
        self.write_packed(slots, quantize(rotate(k), self.fmt.k_bits),
                          quantize(v, self.fmt.v_bits))

    def write_packed(self, slots: Slots, k: Packed, v: Packed) -> None:
        """Store already-packed rows verbatim (checkpoint restore, prefix import)."""
        for dst, src in ((self.k, k), (self.v, v)):
            for a, b in zip(dst, src):
                # mx.array.__setitem__ updates `a` itself (the object the tuple holds); as the
                # sole reference MLX can write the buffer in place instead of copying the pool.
                a[slots.page, slots.offset] = b

    def read_packed(self, slots: Slots) -> tuple[Packed, Packed]:
        """Packed rows [N, heads, ...] of N slots, exactly as stored."""
        return (Packed(*(a[slots.page, slots.offset] for a in self.k)),
                Packed(*(a[slots.page, slots.offset] for a in self.v)))

    def gather_packed(self, pages: mx.array) -> PackedKV:
        """History for page tables [B, P] as packed [B, heads, P*page_tokens, ...]."""
        b, p = pages.shape

        def take(a):
            g = a[pages].reshape(b, p * self.page_tokens, *a.shape[2:])
            return g.transpose(0, 2, 1, 3)

        return PackedKV(Packed(*(take(a) for a in self.k)), Packed(*(take(a) for a in self.v)))

    def gather(self, pages: mx.array) -> tuple[mx.array, mx.array]:
        """Dequantized K (back in the model's basis) and V, [B, heads, P*page_tokens, dim]."""
        hist = self.gather_packed(pages)
        k = dequantize(hist.k, self.fmt.k_bits) @ rotation_matrix(self.fmt.head_dim).T
        return k, dequantize(hist.v, self.fmt.v_bits)

    def arrays(self) -> list[mx.array]:
        return [*self.k, *self.v]


def packed_layer_factory(fmt_name: str, prefill_mode: str = "direct",
                         permit: Optional[Callable[[int], bool]] = None):
    """A KVStore layer_factory: full-attention layers packed in `fmt_name`, others native.

    Refuses (KVFormatError) a packed format on a model whose full-attention layers cannot hold
    it, instead of quietly storing them native. One PackedAttention per layer keeps per-layer
    counters; `counters_of(kvstore)` sums them.
    """

    def make(geometry: LayerGeometry, num_pages: int, page_tokens: int, dtype: mx.Dtype):
        dtype_name = str(dtype).removeprefix("mlx.core.")
        fmt = KVFormat(fmt_name, geometry.head_dim, dtype_name)
        if not fmt.packed or geometry.kind != "full":
            return NativeLayerStore(geometry, num_pages, page_tokens, dtype)
        return PackedLayerStore(geometry, fmt, num_pages, page_tokens,
                                PackedAttention(fmt, prefill_mode, permit))

    return make


def counters_of(kvstore) -> dict:
    total: dict[str, int] = {}
    for store in kvstore.layers.values():
        if getattr(store, "packed", False):
            for k, v in store.attention.counters.as_dict().items():
                total[k] = total.get(k, 0) + v
    return total


def layer_report(kvstore) -> list[dict]:
    """Per paged layer: what it stores (format identity and exact bytes per token)."""
    out = []
    for index, store in sorted(kvstore.layers.items()):
        if getattr(store, "packed", False):
            ident = store.fmt.identity
        else:
            g = kvstore.geometry.layers[index]
            ident = KVFormat("native", g.head_dim, str(kvstore.dtype).removeprefix("mlx.core.")).identity
        out.append({"layer": index, "storage": ident,
                    "bytes_per_token": store.page_bytes // kvstore.page_tokens})
    return out


def storage_identity(kvstore) -> str:
    """One string naming every paged layer's storage: what prefix keys and checkpoints bind."""
    return ";".join(f"{r['layer']}={r['storage']}" for r in layer_report(kvstore))
