"""Which store each paged layer gets for a KV format: a KVStore layer_factory.

Native formats and layers that are not full attention keep native pages; packed formats get a
PackedLayerStore (engine/kv/packed_store.py), page-key formats its PageKeyStore subclass
(engine/kv/page_key_store.py). Stores only: the attention that reads a packed layer is bound by
engine.attention.layers.packed_layer_factory, which wraps this.
"""
from __future__ import annotations

import mlx.core as mx

from capacity.formats import KVFormat
from engine.kv.packed_store import PackedLayerStore
from engine.kv.page_key_store import PageKeyStore
from engine.kv.store import LayerStore, NativeLayerStore
from engine.kv.tails import TailMap
from engine.model.loader import LayerGeometry


def store_factory(fmt_name: str, tail_slots: int = 0, writer=None, cpu_writes: bool = False,
                  chunk_writer=None):
    """A KVStore layer_factory: full-attention layers packed in `fmt_name`, others native.

    Refuses (KVFormatError) a packed format on a model whose full-attention layers cannot hold
    it, instead of quietly storing them native. `writer`: the write kernel packed stores may
    use (PackedLayerStore); `cpu_writes`: page-key stores quantize their writes in compiled
    loops on the CPU, `chunk_writer`: their host-planned writes through this CUDA kernel module
    (PageKeyStore). engine.attention.layers.packed_layer_factory wraps this
    with the attention each packed layer is read by.
    """
    tails: dict[int, TailMap] = {}   # one map per page size, shared by every layer

    def make(geometry: LayerGeometry, num_pages: int, page_tokens: int,
             dtype: mx.Dtype) -> LayerStore:
        dtype_name = str(dtype).removeprefix("mlx.core.")
        fmt = KVFormat(fmt_name, geometry.head_dim, dtype_name, page_tokens)
        if not fmt.packed or geometry.kind != "full":
            return NativeLayerStore(geometry, num_pages, page_tokens, dtype)
        tail = None
        if fmt.native_tail:
            if page_tokens not in tails:
                tails[page_tokens] = TailMap(tail_slots, page_tokens)
            tail = tails[page_tokens]
        if fmt.page_keys:
            return PageKeyStore(geometry, fmt, num_pages, page_tokens, tail, writer, cpu_writes,
                                chunk_writer)
        return PackedLayerStore(geometry, fmt, num_pages, page_tokens, tail, writer)

    return make
