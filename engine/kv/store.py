"""Physical KV pages: one store per paged layer, written by slot and gathered by page table.

A slot is `page * page_tokens + offset`. Page ids and their lifetimes live in `engine/kv/pages.py`
(ids only); this module only holds the arrays. Every layer store is a `LayerStore`: the base
declares each capability the engine may ask of a store, with its default, so a packed
(quantized) layer store (engine/kv/packed_store.py) can replace the native one without the
runner or attention probing for members. Which attention cache reads a store is attention's
business (engine/attention/layers.py), not the store's.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Callable

import mlx.core as mx
import numpy as np

from engine.kv.pages import DEFAULT_PAGE_TOKENS
from engine.model.loader import LayerGeometry, ModelGeometry


class Slots:
    """Where N new tokens go: physical page and in-page offset, computed once per step.

    Held as host arrays; the device index arrays a store asks for (`page`, `offset`,
    `head_major`, `token_major`) are made on first use and shared by every layer of the step,
    so a step pays only for the forms its stores use.
    """

    __slots__ = ("page_np", "offset_np", "count", "_page", "_offset", "_by_heads", "_runs")
    # A compiled step's tail slots per row and its fused page-key writer
    # (engine/runner/compiled_decode.DeviceSlots); host slots have none: native-tail stores plan
    # their tails from page_np / offset_np and write with MLX ops.
    tail_before = tail_write = page_key_writer = None

    def __init__(self, page: np.ndarray, offset: np.ndarray):
        self.page_np = np.asarray(page, dtype=np.int32)       # [N]
        self.offset_np = np.asarray(offset, dtype=np.int32)   # [N]
        self.count = int(self.page_np.size)
        self._page = self._offset = self._runs = None
        self._by_heads: dict = {}

    def only_slot(self) -> tuple[int, int] | None:
        """(page, offset) on the host when exactly one token is written, else None."""
        if self.count != 1:
            return None
        return int(self.page_np[0]), int(self.offset_np[0])

    def runs(self) -> list[tuple[int, int, int, int]]:
        """The tokens as stretches of consecutive slots in one page: (page, offset, first
        token, count) each, in token order; computed once per step."""
        if self._runs is None:
            cut = np.flatnonzero((np.diff(self.page_np) != 0) | (np.diff(self.offset_np) != 1)) + 1
            starts = np.concatenate([[0], cut]).astype(np.int64)
            counts = np.diff(np.concatenate([starts, [self.count]]))
            self._runs = [(int(self.page_np[a]), int(self.offset_np[a]), int(a), int(n))
                          for a, n in zip(starts, counts)]
        return self._runs

    @classmethod
    def from_flat(cls, slots: np.ndarray, page_tokens: int) -> "Slots":
        slots = np.asarray(slots, dtype=np.int64)
        return cls(slots // page_tokens, slots % page_tokens)

    @property
    def page(self) -> mx.array:
        """[N] int32 physical page of each token."""
        if self._page is None:
            self._page = mx.array(self.page_np)
        return self._page

    @property
    def offset(self) -> mx.array:
        """[N] int32 offset of each token in its page."""
        if self._offset is None:
            self._offset = mx.array(self.offset_np)
        return self._offset

    def head_major(self, heads: int) -> tuple[mx.array, mx.array, mx.array]:
        """(head, page, offset) index arrays [heads, N] for head-major pages, built once per
        step and shared by every layer: a write indexed by them is one scatter, where slicing
        the head axis costs each layer's write an arange, index casts and broadcasts (on CUDA,
        where a decode step is bound by the nodes it issues, 10 fewer nodes per layer)."""
        key = ("head", heads)
        if key not in self._by_heads:
            shape = (heads, self.count)
            self._by_heads[key] = tuple(
                mx.array(np.ascontiguousarray(np.broadcast_to(a, shape)))
                for a in (np.arange(heads, dtype=np.int32)[:, None],
                          self.page_np[None, :], self.offset_np[None, :]))
        return self._by_heads[key]

    def token_major(self, heads: int) -> tuple[mx.array, mx.array, mx.array]:
        """(head, page, offset) index arrays [N, heads, 1] for head-major pages: indexing the
        pages with them selects [N, heads, 1, dim], the layout a decode step's keys and values
        already have ([B, heads, 1, dim]), so a one-token write is one scatter with no
        transpose or reshape of the rows first (2 nodes per array instead of 4)."""
        key = ("token", heads)
        if key not in self._by_heads:
            shape = (self.count, heads, 1)
            self._by_heads[key] = tuple(
                mx.array(np.ascontiguousarray(np.broadcast_to(a, shape)))
                for a in (np.arange(heads, dtype=np.int32)[None, :, None],
                          self.page_np[:, None, None], self.offset_np[:, None, None]))
        return self._by_heads[key]


class LayerStore(ABC):
    """The contract of one paged layer's store: every capability, with its default.

    Required: `page_tokens`, `page_bytes` (exact physical bytes of one page), `nbytes` (bytes
    allocated), `write(slots, k, v)` (k: [N, kv_heads, head_dim], v: [N, kv_heads, v_dim]),
    `gather(pages)` (page tables [B, P] -> K, V [B, kv_heads, P*page_tokens, dim], in the model's
    basis), `arrays()` (what must be evaluated for a step to retire) and `grow(num_pages)`
    (hold more pages, keeping every page's contents: KVStore.grow)."""

    page_tokens: int
    page_bytes: int
    nbytes: int
    # Rows kept as codes (capacity.formats KVFormat.packed): `fmt` names the format, attention
    # reads history through `gather_packed`, checkpoints move rows with read/write_packed.
    packed = False
    fmt = None
    # A compiled decode step may stand in for this store (`traced`, `adopt`): its decode writes
    # and reads touch only the device arrays `arrays()` returns.
    can_trace = False
    # A CUDA decode kernel may store a decode step's own rows into these pages itself (no
    # scatter in the step's graph), where KernelChoices.decode_writes_own allows it.
    decode_writes_own = False
    # Attention reads whole pages of history (per-page metadata), never a cut to the rows needed.
    whole_pages = False
    # Native rows at the start of every page (sink formats) and the native tail pool shared by
    # the layers (native-tail formats), with its bytes per running sequence.
    sink_rows = 0
    tails = None
    tail_bytes_per_request = 0
    # Host-planned writes go through this CUDA kernel module (page-key stores:
    # KernelChoices.page_key_chunk_write); None: MLX ops (or the CPU's loops).
    chunk_writer = None

    @abstractmethod
    def write(self, slots: "Slots", k: mx.array, v: mx.array) -> None:
        """Store token rows k, v ([N, kv_heads, dim], N = slots' count) into their slots."""

    def write_decode(self, slots: "Slots", keys: mx.array, values: mx.array) -> None:
        """One token per row in the model's layout ([N, kv_heads, 1, dim]); a store with a
        cheaper one-token write overrides this."""
        n, h, _, d = keys.shape
        self.write(slots, keys.reshape(n, h, d), values.reshape(n, h, values.shape[-1]))

    @abstractmethod
    def gather(self, pages: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values of `pages` ([B, P] page ids) as [B, kv_heads, P*T, dim] arrays."""

    @abstractmethod
    def arrays(self) -> list[mx.array]:
        """Every array the store holds (what a compiled step takes and hands back)."""

    @abstractmethod
    def grow(self, num_pages: int) -> None:
        """Hold `num_pages` pages from now on (no-op where it holds them already): the pages held
        keep their rows, the new ones are zero. `nbytes` follows; `page_bytes` does not change."""

    def head_major_pages(self) -> tuple[mx.array, mx.array] | None:
        """The page arrays [kv_heads, num_pages, T, dim] for attention that reads pages in place,
        or None where the pages are not laid out that way."""
        return None

    def traced(self, arrays: list[mx.array]) -> "LayerStore":
        raise ValueError(f"{type(self).__name__} cannot stand in for a compiled step")

    def adopt(self, arrays: list[mx.array]) -> None:
        raise ValueError(f"{type(self).__name__} cannot stand in for a compiled step")


# A write goes by slice updates on the CPU where its stretches of consecutive slots average at
# least this many tokens (NativeLayerStore.write).
RUN_TOKENS = 16


class NativeLayerStore(LayerStore):
    """Pages of one layer in the compute dtype, laid out head-major: [heads, num_pages, T, dim].

    Head-major pages gather into [heads, B, P*T, dim], whose transpose to [B, heads, P*T, dim]
    keeps every (row, head) matrix contiguous, so attention reads the gathered copy directly.
    Token-major pages ([num_pages, T, heads, dim]) are slower per layer (the attention then
    works on a strided copy; measured: docs/lab/engine-notes.md).
    """

    can_trace = True
    # The CUDA decode kernel writes a decode step's keys into these pages itself
    # (cuda/paged_decode.py, `own`): they are whole row-contiguous arrays this store holds.
    decode_writes_own = True

    def __init__(self, geometry: LayerGeometry, num_pages: int, page_tokens: int,
                 dtype: mx.Dtype):
        self.page_tokens = page_tokens
        self.k = mx.zeros((geometry.kv_heads, num_pages, page_tokens, geometry.head_dim), dtype)
        self.v = mx.zeros((geometry.kv_heads, num_pages, page_tokens, geometry.v_head_dim), dtype)
        mx.eval(self.k, self.v)
        self.page_bytes = (self.k.nbytes + self.v.nbytes) // num_pages
        self.nbytes = self.k.nbytes + self.v.nbytes

    def grow(self, num_pages: int) -> None:
        self.k = grown(self.k, 1, num_pages)
        self.v = grown(self.v, 1, num_pages)
        self.nbytes = self.k.nbytes + self.v.nbytes

    def write(self, slots: Slots, k: mx.array, v: mx.array) -> None:
        # Scatter into the sole reference, so MLX updates the buffer in place (no page copy).
        if k.dtype != self.k.dtype:
            k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
        k, v = k.swapaxes(0, 1), v.swapaxes(0, 1)
        if mx.default_device() == mx.cpu and slots.count >= RUN_TOKENS * len(slots.runs()):
            # A prompt's tokens fill consecutive slots: one slice update per stretch. MLX's CPU
            # scatter computes every element's index (~2.8 us a token here, 1.4 ms of a
            # 485-token chunk's layer); a slice update is a copy (~20 us each).
            for page, offset, first, n in slots.runs():
                self.k[:, page, offset:offset + n] = k[:, first:first + n]
                self.v[:, page, offset:offset + n] = v[:, first:first + n]
            return
        heads, pages, offsets = slots.head_major(self.k.shape[0])
        self.k[heads, pages, offsets] = k
        self.v[heads, pages, offsets] = v

    def write_decode(self, slots: Slots, keys: mx.array, values: mx.array) -> None:
        """One token per row, in the model's layout: keys [N, kv_heads, 1, head_dim] (values
        likewise) go to `slots` by one scatter each (`Slots.token_major`), or for one row by
        one slice update each."""
        if keys.dtype != self.k.dtype:
            keys, values = keys.astype(self.k.dtype), values.astype(self.v.dtype)
        only = slots.only_slot()
        if only is not None:
            # One row (batch-1 decode): a slice update at host-known coordinates, as mlx-lm's
            # own cache writes (a scatter's indices with a leading 1 cost a squeeze and a
            # broadcast more). [1, heads, 1, dim] -> [heads, 1, 1, dim].
            page, offset = only
            self.k[:, page:page + 1, offset:offset + 1] = keys.swapaxes(0, 1)
            self.v[:, page:page + 1, offset:offset + 1] = values.swapaxes(0, 1)
            return
        heads, pages, offsets = slots.token_major(self.k.shape[0])
        self.k[heads, pages, offsets] = keys
        self.v[heads, pages, offsets] = values

    def gather(self, pages: mx.array) -> tuple[mx.array, mx.array]:
        b, p = pages.shape
        k = self.k[:, pages].reshape(self.k.shape[0], b, p * self.page_tokens, self.k.shape[-1])
        v = self.v[:, pages].reshape(self.v.shape[0], b, p * self.page_tokens, self.v.shape[-1])
        return k.swapaxes(0, 1), v.swapaxes(0, 1)

    def arrays(self) -> list[mx.array]:
        return [self.k, self.v]

    def head_major_pages(self) -> tuple[mx.array, mx.array]:
        """The page arrays themselves, for attention that reads pages in place."""
        return self.k, self.v

    def traced(self, arrays: list[mx.array]) -> "NativeLayerStore":
        """A stand-in holding `arrays` (as `arrays()` orders them) for a compiled step's trace
        (engine/runner/compiled_decode.py): writes go to it, never to this store."""
        stand_in = copy.copy(self)
        stand_in.adopt(arrays)
        return stand_in

    def adopt(self, arrays: list[mx.array]) -> None:
        """Hold `arrays` (a compiled step's written pages) from now on."""
        self.k, self.v = arrays


def grown(a: mx.array, axis: int, num_pages: int) -> mx.array:
    """`a` with its page axis extended to `num_pages` by zero pages, evaluated now (`a` itself
    where it has them already: a growth retried after a failure). A store swaps its arrays one
    at a time, so a growth needs the old copy of one array at most beside the grown pool (the
    old array is freed once nothing else holds it), never a second pool."""
    extra = list(a.shape)
    extra[axis] = num_pages - a.shape[axis]
    if extra[axis] <= 0:
        return a
    out = mx.concatenate([a, mx.zeros(extra, a.dtype)], axis=axis)
    mx.eval(out)
    return out


LayerStoreFactory = Callable[[LayerGeometry, int, int, mx.Dtype], LayerStore]


class KVStore:
    """All paged layers' physical pages. Page `p` means the same token slots in every layer.

    `num_pages` is the id space (what the budget pays for); `allocated_pages` (the first
    `initial_pages`, default all) are backed by memory now, and `grow` backs more, on the engine
    thread, when the page pool hands out ids past them (engine/kv/pages.py)."""

    def __init__(self, geometry: ModelGeometry, num_pages: int,
                 page_tokens: int = DEFAULT_PAGE_TOKENS, dtype: mx.Dtype = mx.float32,
                 layer_factory: LayerStoreFactory = NativeLayerStore,
                 initial_pages: int | None = None):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_tokens < 1 or page_tokens & (page_tokens - 1):
            raise ValueError(f"page_tokens must be a power of two, got {page_tokens}")
        initial_pages = num_pages if initial_pages is None else initial_pages
        if not 1 <= initial_pages <= num_pages:
            raise ValueError(f"initial_pages must be in [1, {num_pages}], got {initial_pages}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.allocated_pages = initial_pages
        self.page_tokens = page_tokens
        self.dtype = dtype
        self.layers: dict[int, LayerStore] = {
            g.index: layer_factory(g, initial_pages, page_tokens, dtype)
            for g in geometry.layers if g.paged}
        self.growths = 0   # how many times the pool grew (stats, tests)

    def grow(self, pages: int) -> None:
        """Back the first `pages` pages (more than now, at most `num_pages`) in every layer.

        Called by the page pool before it hands out an id past `allocated_pages`, between steps
        on the engine thread: a step built before reads the arrays it was built with, and a
        step in flight is waited for (each grown array is evaluated, and it depends on that
        step's writes). Layer by layer, so the memory held at the peak is the grown pool plus
        one layer's old array. A failure (out of memory) raises with the pool's size unchanged
        in the page pool; layers already grown keep their larger arrays (unused ids)."""
        if not self.allocated_pages < pages <= self.num_pages:
            raise ValueError(f"cannot grow the KV store from {self.allocated_pages} to "
                             f"{pages} pages (id space {self.num_pages})")
        for store in self.layers.values():
            store.grow(pages)
        self.allocated_pages = pages
        self.growths += 1
        mx.clear_cache()   # the old arrays' buffers go back, not into MLX's buffer cache

    def layer(self, index: int) -> LayerStore:
        return self.layers[index]

    @property
    def page_bytes(self) -> int:
        """Exact physical bytes of one page summed over all paged layers."""
        return sum(s.page_bytes for s in self.layers.values())

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.page_tokens

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers.values())

    @property
    def tail_bytes_per_sequence(self) -> int:
        """Native tail bytes one running sequence holds, summed over layers (0 unless the format
        keeps a native tail page: capacity.formats.KVFormat.tail_bytes_per_request)."""
        return sum(s.tail_bytes_per_request for s in self.layers.values())

    def release_pages(self, pages) -> None:
        """Pages went back to the free list: a native tail they held is gone (PagePool.on_free)."""
        maps = {id(s.tails): s.tails for s in self.layers.values() if s.tails is not None}
        for m in maps.values():
            m.release(pages)

    def arrays(self) -> list[mx.array]:
        return [a for s in self.layers.values() for a in s.arrays()]

    def write(self, layer: int, slots: np.ndarray | Slots, k: mx.array, v: mx.array) -> None:
        """Write K/V rows [N, heads, dim] for N tokens into flat slots (tests and tools)."""
        if not isinstance(slots, Slots):
            slots = Slots.from_flat(slots, self.page_tokens)
        self.layers[layer].write(slots, k, v)

    def gather(self, layer: int, pages: np.ndarray | mx.array) -> tuple[mx.array, mx.array]:
        """K/V [B, heads, P*page_tokens, dim] for page tables [B, P]."""
        return self.layers[layer].gather(mx.array(np.asarray(pages, dtype=np.int32))
                                         if not isinstance(pages, mx.array) else pages)
