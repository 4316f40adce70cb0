"""Packed paged layer store: K/V rows kept as affine codes + FP32 scales + FP32 offsets.

Implements engine.kv.store's per-layer store protocol (page_bytes, nbytes, write, gather, arrays)
so KVStore can hold packed and native layers side by side. Keys are rotated (engine.kv.rotation)
before they are quantized; values are not. All of a layer's codes and metadata live in one
uint32 pool [num_pages, page_words] whose pages are runs of token-major sections
(engine.kv.page_layout), so a write of N rows is one scatter of their records and a gather is
one take per section plus a free reshape.

Attention does not use `gather` (that returns dequantized, un-rotated rows for tools and tests);
it reads `gather_packed` through engine.attention.packed_cache (which attention object and cache
serve a store is engine.attention.layers' business), and checkpoints move rows with
`read_packed`/`write_packed`, which never requantize.

Formats with sink rows (capacity.formats) also keep the first `sink_rows` tokens of every page
in the model's dtype, unrotated, in [num_pages, sink_rows, kv_heads, dim] arrays beside the codes
(`read_sinks`/`write_sinks` move them verbatim); attention reads a sequence's first tokens from
its first page's native rows (engine.attention.packed_cache).

Page-key formats (int4-kivi) are engine.kv.page_key_store's subclass of this store.

Formats with a native tail (int4-tail) also keep each sequence's partial last page native, in a
pool of `tails.num_slots` pages per layer ([slots, page_tokens, kv_heads, dim] for K and V) that
every layer indexes through one shared engine.kv.tails.TailMap. Codes are written for every row
as usual (token-local groups: the same codes a page would get if quantized when it fills); the
native copy is what attention reads until the page is full. A layer writes its native tail rows
after its attention (`flush_tail`), so a step still reads the tails it began with.
"""
from __future__ import annotations

import copy
from typing import Optional

import mlx.core as mx
import numpy as np

from capacity.formats import GROUP_SIZE, KVFormat, KVFormatError
from engine.kv.store import LayerStore, NativeLayerStore, Slots, grown
from engine.model.loader import LayerGeometry
from engine.kv.page_layout import (K_SECTIONS, SECTIONS, V_SECTIONS, PageLayout,
                                   packed_record)
from engine.kv.quant import Packed, PackedKV, dequantize, quantize
from engine.kv.rotation import rotate, rotation_matrix
from engine.kv.tails import TailMap


class PackedLayerStore(LayerStore):
    """One full-attention layer's pages in a packed format.

    `writer`: a write kernel (engine/attention/cuda/packed_write.py's functions `usable`,
    `quantize_record`, `write_in_place`) the store may quantize its rows with, or None for MLX
    ops; the store takes it only where it serves this format here."""

    packed = True

    def __init__(self, geometry: LayerGeometry, fmt: KVFormat, num_pages: int, page_tokens: int,
                 tails: Optional[TailMap] = None, writer=None):
        if geometry.kind != "full":
            raise KVFormatError(f"layer {geometry.index} is {geometry.kind}; only full-attention "
                                "layers are packed")
        if geometry.v_head_dim != geometry.head_dim:
            raise KVFormatError(f"layer {geometry.index}: packed KV needs equal K and V head dims")
        if fmt.head_dim != geometry.head_dim:
            raise KVFormatError(f"format bound to head_dim {fmt.head_dim}, layer has "
                                f"{geometry.head_dim}")
        if fmt.page_tokens not in (None, page_tokens):
            raise KVFormatError(f"format bound to pages of {fmt.page_tokens} tokens, store has "
                                f"{page_tokens}")
        self.geometry = geometry
        self.fmt = fmt.paged(page_tokens)   # its identity names the page size where it matters
        self.page_tokens = page_tokens
        self.writer = (writer if writer is not None
                       and writer.usable(fmt.k_bits, fmt.v_bits, geometry.head_dim) else None)
        h, d = geometry.kv_heads, geometry.head_dim
        # Page keys (int4-kivi) keep their per-page metadata in rows of group page_tokens.
        self.layout = PageLayout.for_format(page_tokens, h, d, fmt.k_bits, fmt.v_bits,
                                            fmt.k_row_group(page_tokens), GROUP_SIZE)
        self.pool = self.layout.zeros(num_pages)
        self.sink_rows = fmt.sink_rows
        if self.sink_rows > page_tokens:
            raise KVFormatError(f"format {fmt.name} keeps {self.sink_rows} native rows per page; "
                                f"pages of {page_tokens} tokens cannot hold them")
        self.sinks: tuple[mx.array, ...] = ()
        if self.sink_rows:
            dtype = getattr(mx, fmt.native_dtype)
            self.sinks = (mx.zeros((num_pages, self.sink_rows, h, d), dtype),
                          mx.zeros((num_pages, self.sink_rows, h, d), dtype))
        self.tails = tails if fmt.native_tail else None
        self.tail: tuple[mx.array, ...] = ()
        self._pending = None
        if fmt.native_tail:
            if tails is None:
                raise KVFormatError(f"format {fmt.name} keeps each sequence's tail page native: "
                                    "it needs a TailMap sized by concurrency (tail_slots)")
            if self.sink_rows:
                raise KVFormatError(f"format {fmt.name}: sink rows and a native tail together "
                                    "are not supported")
            if tails.page_tokens != page_tokens:
                raise KVFormatError(f"tail map for pages of {tails.page_tokens} tokens, store "
                                    f"has {page_tokens}")
            dtype = getattr(mx, fmt.native_dtype)
            self.tail = tuple(mx.zeros((tails.num_slots, page_tokens, h, d), dtype)
                              for _ in range(2))
        mx.eval(*self.arrays())
        self.nbytes = sum(a.nbytes for a in self.arrays())
        # The tail pool is priced per running sequence, not per page (capacity.formats).
        self.tail_bytes = sum(a.nbytes for a in self.tail)
        self.tail_bytes_per_request = self.tail_bytes // tails.num_slots if self.tail else 0
        self.page_bytes = (self.nbytes - self.tail_bytes) // num_pages

    def grow(self, num_pages: int) -> None:
        """More pages of codes (and native sink rows); the native tail pool is per running
        sequence, not per page, and keeps its size."""
        self.pool = grown(self.pool, 0, num_pages)
        self.sinks = tuple(grown(a, 0, num_pages) for a in self.sinks)
        self.nbytes = sum(a.nbytes for a in (self.pool, *self.sinks, *self.tail))

    @property
    def k(self) -> Packed:
        """Every page's key codes, scales and offsets, [num_pages, page_tokens, heads, width]
        (copies out of the pool: for inspection and tests, not for attention)."""
        return Packed(*(self.layout.section(self.pool, n) for n in K_SECTIONS))

    @property
    def v(self) -> Packed:
        """As `k`, for values."""
        return Packed(*(self.layout.section(self.pool, n) for n in V_SECTIONS))

    @property
    def decode_writes_own(self) -> bool:
        """Decode rows may go into the pool through the write kernel itself
        (`write(..., in_place=True)`): a format it serves, the pool the layer's only state."""
        return self.can_trace and self.writer is not None

    def write(self, slots: Slots, k: mx.array, v: mx.array, in_place: bool = False) -> None:
        """Quantize N new rows ([N, heads, dim], keys after RoPE) into their slots. `in_place`:
        the CUDA write kernel stores them into the pool itself, no scatter; the pool held after
        is the same buffer made to depend on that write (so the step's readers follow it)."""
        if in_place:
            if "slot_pairs" not in slots._by_heads:   # [N, 2] page, offset: once per step
                slots._by_heads["slot_pairs"] = mx.stack([slots.page, slots.offset], axis=1)
            self.pool = mx.depends(self.pool, self.writer.write_in_place(
                k, v, self.fmt.k_bits, self.fmt.v_bits, self.layout, self.pool,
                slots._by_heads["slot_pairs"]))
            return
        if self.fmt.codes_only and self.writer is not None:
            # CUDA: the same rotation and quantization in one kernel launch (not ~40 ops),
            # emitted as the rows' pool records.
            records = self.writer.quantize_record(k, v, self.fmt.k_bits, self.fmt.v_bits,
                                                        self.layout)
        else:
            records = packed_record(quantize(rotate(k), self.fmt.k_bits, self.fmt.k_group),
                                    quantize(v, self.fmt.v_bits))
        self.layout.write_rows(self.pool, self._row_index(slots), records)
        if self.sink_rows:
            self._write_sinks(slots, k, v, self._sink_index(slots))
        if self.tails is not None:
            self.flush_tail()
            plan = self._tail_plan(slots)
            if plan.rows is not None:
                self._pending = self._tail_rows_of(slots, plan, k, v)

    # ---- native tail (formats with native_tail) ------------------------------------------------

    def plan_step(self, slots: Slots) -> None:
        """Make the step's shared plans now rather than at the first write: a merged mixed
        step's row groups plan in turn before any of them writes (engine/runner/merged.py)."""
        if self.tails is not None:
            self._tail_plan(slots)

    def _tail_plan(self, slots: Slots):
        """The step's tail plan, computed by the first layer that writes and shared by all."""
        key = ("tail_plan", id(self.tails))
        if key not in slots._by_heads:
            slots._by_heads[key] = self.tails.plan(np.array(slots.page), np.array(slots.offset))
        return slots._by_heads[key]

    def _tail_rows_of(self, slots: Slots, plan, k: mx.array, v: mx.array) -> tuple:
        """The write's pending native tail rows (slots, offsets, keys, values) under `plan`.
        The index arrays are made once per step for every layer, and a step whose rows all
        stay in partial pages (most decode steps) hands its keys and values over as they are,
        not through a gather per layer."""
        key = ("tail_rows", id(self.tails))
        if key not in slots._by_heads:
            every = len(plan.rows) == slots.count   # plan.rows ascending: then all of them
            idx = None if every else mx.array(plan.rows)
            slots._by_heads[key] = (idx, mx.array(plan.slots),
                                    slots.offset if every else slots.offset[idx])
        idx, where, offset = slots._by_heads[key]
        return (where, offset, k, v) if idx is None else (where, offset, k[idx], v[idx])

    def flush_tail(self) -> None:
        """Write the last write's native tail rows into their slots (after attention read the
        tails the step began with; also before anything else reads the pool)."""
        if self._pending is None:
            return
        slot, offset, k, v = self._pending
        self._pending = None
        for dst, rows in zip(self.tail, (k, v)):
            dst[slot, offset] = rows.astype(dst.dtype)

    def detach_tail_rows(self):
        """The last write's pending native tail rows, taken out of the store (None: none).
        A merged mixed step (engine/runner/merged.py) writes every row group of a layer before
        any of them attends: each group's cache holds its own rows aside so the next group's
        write does not flush them before this group read its tails (a slot a filled page gave
        back may hold another page's new rows by then), and `attach_tail_rows` hands them back
        for its attention to flush after reading."""
        pending, self._pending = self._pending, None
        return pending

    def attach_tail_rows(self, pending) -> None:
        """Hand back rows `detach_tail_rows` took (flushing any others first, as `write` does)."""
        self.flush_tail()
        self._pending = pending

    def gather_tail(self, slot_per_row: np.ndarray) -> tuple[mx.array, mx.array]:
        """Native tail pages of B rows (slot -1: none, reads slot 0; callers mask it) as K, V
        [B, heads, page_tokens, dim], model basis."""
        idx = mx.array(np.maximum(slot_per_row, 0).astype(np.int32))
        return tuple(a[idx].transpose(0, 2, 1, 3) for a in self.tail)

    def read_tail(self, slots: Slots) -> tuple[mx.array, mx.array]:
        """Native rows [M, heads, dim] of the slots whose page is a partial tail, in slot order."""
        self.flush_tail()
        idx, where = self._tail_rows(slots)
        if idx is None:
            empty = mx.zeros((0, self.geometry.kv_heads, self.geometry.head_dim), self.tail[0].dtype)
            return empty, empty
        return tuple(a[mx.array(where), slots.offset[idx]] for a in self.tail)

    def write_tail(self, slots: Slots, k: mx.array, v: mx.array) -> None:
        """Store native tail rows verbatim (checkpoint restore): each slot's page takes a tail
        slot if it has none."""
        self.flush_tail()
        pages = np.array(slots.page)
        where = np.array([self.tails.claim(int(p)) for p in pages], dtype=np.int32)
        if k.shape[0] != len(where) or v.shape[0] != len(where):
            raise KVFormatError(f"expected {len(where)} tail rows, got {k.shape[0]}")
        if len(where):
            for dst, rows in zip(self.tail, (k, v)):
                dst[mx.array(where), slots.offset] = rows.astype(dst.dtype)

    def _tail_rows(self, slots: Slots):
        pages = np.array(slots.page)
        keep = [i for i, p in enumerate(pages) if int(p) in self.tails.slot_of]
        if not keep:
            return None, None
        where = np.array([self.tails.slot_of[int(pages[i])] for i in keep], dtype=np.int32)
        return mx.array(np.array(keep, dtype=np.int32)), where

    def _sink_index(self, slots: Slots) -> mx.array | None:
        """Which of the slots land in a page's native sink rows (None: none), once per step."""
        key = ("sink_rows", self.sink_rows)
        if key not in slots._by_heads:   # the step's per-layer index cache, shared by layers
            keep = np.flatnonzero(np.array(slots.offset) < self.sink_rows)
            slots._by_heads[key] = mx.array(keep.astype(np.int32)) if keep.size else None
        return slots._by_heads[key]

    def _write_sinks(self, slots: Slots, k: mx.array, v: mx.array, idx: mx.array | None):
        if idx is None:
            return
        page, offset = slots.page[idx], slots.offset[idx]
        for dst, rows in zip(self.sinks, (k, v)):
            dst[page, offset] = rows[idx].astype(dst.dtype)

    def read_sinks(self, slots: Slots) -> tuple[mx.array, mx.array] | None:
        """Native sink rows [M, heads, dim] of the slots with offset < sink_rows, in slot order."""
        if not self.sink_rows:
            return None
        idx = self._sink_index(slots)
        if idx is None:
            d = self.geometry.head_dim
            empty = mx.zeros((0, self.geometry.kv_heads, d), self.sinks[0].dtype)
            return empty, empty
        page, offset = slots.page[idx], slots.offset[idx]
        return tuple(a[page, offset] for a in self.sinks)

    def write_sinks(self, slots: Slots, k: mx.array, v: mx.array) -> None:
        """Store native sink rows read by `read_sinks` verbatim (checkpoint restore)."""
        idx = self._sink_index(slots)
        n = 0 if idx is None else idx.size
        if k.shape[0] != n or v.shape[0] != n:
            raise KVFormatError(f"expected {n} sink rows for these slots, got {k.shape[0]}")
        if n:
            page, offset = slots.page[idx], slots.offset[idx]
            for dst, rows in zip(self.sinks, (k, v)):
                dst[page, offset] = rows.astype(dst.dtype)

    def gather_sinks(self, pages: mx.array) -> tuple[mx.array, mx.array]:
        """Native sink rows of page tables [B, P] as K, V [B, heads, P*sink_rows, dim] (model
        basis), page by page."""
        b, p = pages.shape
        return tuple(a[pages].reshape(b, p * self.sink_rows, *a.shape[2:]).transpose(0, 2, 1, 3)
                     for a in self.sinks)

    def _row_index(self, slots: Slots, names=SECTIONS) -> tuple[mx.array, mx.array]:
        """(pages, columns) of the slots' records in the pool: built once per step (on the
        device, from the step's page and offset arrays) and shared by every layer of this
        layout."""
        key = ("page_layout", self.layout, names)
        if key not in slots._by_heads:
            slots._by_heads[key] = self.layout.row_index(slots.page, slots.offset, names)
        return slots._by_heads[key]

    def write_packed(self, slots: Slots, k: Packed, v: Packed) -> None:
        """Store already-packed rows verbatim (also checkpoint restore, prefix import)."""
        self.layout.write_rows(self.pool, self._row_index(slots), packed_record(k, v))

    def read_packed(self, slots: Slots) -> tuple[Packed, Packed]:
        """Packed rows [N, heads, ...] of N slots, exactly as stored."""
        kc, vc, ks, ko, vs, vo = self.layout.read_rows(self.pool, slots.page, slots.offset)
        return Packed(kc, ks, ko), Packed(vc, vs, vo)

    def gather_packed(self, pages: mx.array) -> PackedKV:
        """History for page tables [B, P] as packed [B, heads, P*page_tokens, ...]."""
        return PackedKV(*(Packed(*(self.layout.gather(self.pool, pages, n) for n in names))
                          for names in (K_SECTIONS, V_SECTIONS)))

    def gather(self, pages: mx.array) -> tuple[mx.array, mx.array]:
        """Dequantized K (back in the model's basis) and V, [B, heads, P*page_tokens, dim]; a
        partial tail page (native-tail formats) is its native copy."""
        self.flush_tail()
        hist = self.gather_packed(pages)
        k = dequantize(hist.k, self.fmt.k_bits) @ rotation_matrix(self.fmt.head_dim).T
        v = dequantize(hist.v, self.fmt.v_bits)
        if self.sink_rows:   # what attention reads: each page's first rows are native
            b, p = pages.shape
            t, s = self.page_tokens, self.sink_rows
            native = [a[pages].astype(mx.float32).transpose(0, 3, 1, 2, 4) for a in self.sinks]
            k, v = (x.reshape(b, x.shape[1], p, t, -1) for x in (k, v))
            k = mx.concatenate([native[0], k[:, :, :, s:]], axis=3).reshape(b, -1, p * t, k.shape[-1])
            v = mx.concatenate([native[1], v[:, :, :, s:]], axis=3).reshape(b, -1, p * t, v.shape[-1])
        if self.tails is not None and self.tails.slot_of:
            k, v = self._with_tails(np.array(pages), k, v)
        return k, v

    def _with_tails(self, pages: np.ndarray, k: mx.array, v: mx.array):
        t = self.page_tokens
        pos, src = [], []
        for (b, j), page in np.ndenumerate(pages):
            if int(page) in self.tails.slot_of:
                pos.append((b, j))
                src.append(self.tails.slot_of[int(page)])
        if not pos:
            return k, v
        out = []
        for x, pool in zip((k, v), self.tail):
            x = x.reshape(x.shape[0], x.shape[1], pages.shape[1], t, -1)
            for (b, j), slot in zip(pos, src):
                x[b, :, j] = pool[slot].transpose(1, 0, 2).astype(x.dtype)
            out.append(x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1]))
        return tuple(out)

    @property
    def can_trace(self) -> bool:
        """Whether a compiled decode step may stand in for this store (`traced`): its decode
        writes and kernel reads touch the pool only, through device arrays. Native sink rows,
        tails and whole-page keys keep host-side plans per step."""
        return (self.fmt.codes_only and not self.sink_rows and self.tails is None
                and not self.whole_pages)

    def traced(self, arrays: list[mx.array]) -> "PackedLayerStore":
        """A stand-in holding `arrays` (the pool) for a compiled step's trace
        (engine/runner/compiled_decode.py): writes go to it, never to this store."""
        if not self.can_trace:
            raise ValueError(f"format {self.fmt.name}: this store cannot be traced")
        stand_in = copy.copy(self)
        stand_in.adopt(arrays)
        return stand_in

    def adopt(self, arrays: list[mx.array]) -> None:
        """Hold `arrays` (a compiled step's written pool) from now on."""
        (self.pool,) = arrays

    def arrays(self) -> list[mx.array]:
        self.flush_tail()
        return [self.pool, *self.sinks, *self.tail]
