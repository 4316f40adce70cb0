"""Attention's side of a layer store: which cache class reads it, and which PackedAttention
routes and counts a packed layer's calls.

Stores (engine/kv/) hold pages only; this module pairs them with what reads them, so neither the
runner nor a store names the other's classes.
"""
from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.attention.cuda import packed_write as cuda_packed_write
from engine.attention.cuda import page_key_write as cuda_page_key_write
from engine.attention.packed import PackedAttention, attention_of, bind
from engine.attention.packed_cache import PackedLayerCache
from engine.attention.paged import PagedLayerCache
from engine.kv.factory import store_factory
from engine.kv.packed_store import PackedLayerStore
from engine.kv.store import LayerStore
from engine.model.loader import LayerGeometry

# Store class -> the cache class that reads it (the most derived registered class wins).
_CACHES: dict[type, type[PagedLayerCache]] = {PackedLayerStore: PackedLayerCache}


def register_cache(store_type: type, cache_type: type[PagedLayerCache]) -> None:
    """Stores of `store_type` (and its subclasses) are read through `cache_type` (tools with
    their own attention, e.g. quality/variants.py)."""
    _CACHES[store_type] = cache_type


def cache_class_for(store: LayerStore) -> type[PagedLayerCache]:
    for cls in type(store).__mro__:
        if cls in _CACHES:
            return _CACHES[cls]
    return PagedLayerCache


def packed_layer_factory(fmt_name: str, prefill_mode: str = "direct",
                         permit: Optional[Callable[[int], bool]] = None,
                         kernels: KernelChoices = DEFAULT_KERNELS, tail_slots: int = 0):
    """A KVStore layer_factory (engine.kv.factory.store_factory) whose packed layers are each
    read by their own PackedAttention (per-layer counters; `counters_of(kvstore)` sums them).
    `kernels`: the write kernel and direct attention's choices (the runner takes the same
    object for its kernels)."""
    make_store = store_factory(fmt_name, tail_slots,
                               cuda_packed_write if kernels.write_kernel else None,
                               kernels.cpu_page_key_write,
                               None if kernels.page_key_chunk_write is False
                               else cuda_page_key_write.chosen(kernels))

    def make(geometry: LayerGeometry, num_pages: int, page_tokens: int,
             dtype: mx.Dtype) -> LayerStore:
        store = make_store(geometry, num_pages, page_tokens, dtype)
        if store.packed:
            bind(store, PackedAttention(store.fmt, prefill_mode, permit, kernels=kernels))
        return store

    return make


def counters_of(kvstore) -> dict:
    """How the packed layers' attention calls were routed, summed over layers."""
    total: dict[str, int] = {}
    for store in kvstore.layers.values():
        if store.packed:
            for k, v in attention_of(store).counters.as_dict().items():
                total[k] = total.get(k, 0) + v
    return total
