"""Packed store for page keys (int4-kivi): keys per channel over each full page, written on fill.

A PackedLayerStore whose keys are quantized per channel over a whole page (engine.kv.page_quant)
instead of per token. Those codes depend on every row of the page, so rows are not key-quantized
when written: until its page fills, a row's key lives only in the native tail pool (the tail
machinery of int4-tail: engine.kv.tails, PackedLayerStore's tail pool), which is also what
attention reads for a sequence's partial last page. Values are token-local int4 and written for
every row as usual.

Quantize-on-fill: a write that reaches a page's last offset fills it. Its key codes and
per-channel scales are then computed from the page's earlier rows (in its native tail slot as the
step began: the previous step's rows are flushed first) and the write's own rows. That covers a
decode step that completes a page, a prefill chunk that completes one mid-chunk, and a page
written whole by one prefill chunk (no earlier rows, so no tail). The step's attention still reads
that page native (it was the tail when the step began) or as fresh rows; later steps read codes.

Keys are stored unrotated (capacity.formats: `-h0-s0`); attention scores page-key history
through engine.attention.packed's direct path, or on CUDA the page-key kernels
(engine/attention/cuda/page_key_decode.py, page_key_dequant.py).

Compiled decode steps (engine/runner/compiled_decode.py, where the CUDA kernel attends) cannot
plan tails inside their trace: the step plans the shared TailMap on the host and hands each
row's tail slots in as device arrays (`DeviceSlots.tail_before`, `tail_write`), and the write
(`_write_planned`) keys each row's page from its tail rows and the new row every step, so the
page whose last row this is gets its final codes without a host-side fill plan; the codes a
still-partial page gets meanwhile are never read (attention and `read_packed` read its tail).
"""
from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from capacity.formats import GROUP_SIZE, KVFormat, KVFormatError
from engine.kv import cpu_page_key_write
from engine.kv.packed_store import PackedLayerStore
from engine.kv.page_quant import (PagePacked, dequantize_pages, meta_pages, meta_rows,
                                  quantize_pages)
from engine.kv.page_layout import K_SECTIONS, V_SECTIONS, record
from engine.kv.quant import Packed, PackedKV, dequantize, quantize
from engine.kv.store import Slots
from engine.kv.tails import TailMap
from engine.model.loader import LayerGeometry


class FillPlan:
    """One step's quantize-on-fill work, computed once (after the tail plan) for every layer."""

    def __init__(self, pages, rows, where, offsets, sources):
        # NumPy int arrays; `host` keeps them for the CPU write, the attributes on the device.
        self.host = (sources, where, offsets, rows)
        self.pages = mx.array(pages)      # [F] pages this write fills
        self.rows = mx.array(rows)        # the write's rows that land in them
        self.where = mx.array(where)      # per such row: index of its page in `pages`
        self.offsets = mx.array(offsets)  # per such row: offset in the page
        self.sources = mx.array(sources)  # [F] native tail slot holding each page's earlier rows


class PageKeyStore(PackedLayerStore):
    """One full-attention layer in a page-keys format (capacity.formats KVFormat.page_keys)."""

    whole_pages = True   # attention reads whole pages of history (per-page metadata)
    _written_tail = None  # the fused decode write's new (K, V) tails, until attention read

    def __init__(self, geometry: LayerGeometry, fmt: KVFormat, num_pages: int, page_tokens: int,
                 tails: Optional[TailMap] = None, writer=None, cpu_writes: bool = False,
                 chunk_writer=None):
        if not fmt.page_keys or not fmt.native_tail:
            raise KVFormatError(f"format {fmt.name} does not keep page keys with a native tail")
        fmt.k_row_group(page_tokens)   # refuses pages that do not divide head_dim
        super().__init__(geometry, fmt, num_pages, page_tokens, tails, writer)
        # On the CPU with float32 tails, the write's quantization in compiled loops
        # (engine/kv/cpu_page_key_write.py; KernelChoices.cpu_page_key_write).
        self.cpu_writes = (cpu_writes and mx.default_device() == mx.cpu and bool(self.tail)
                           and self.tail[0].dtype == mx.float32)
        # CUDA: host-planned writes (prefill chunks, uncompiled decode) through the fused write
        # kernel (engine/attention/cuda/page_key_write.py, `chunk_writer`: that module, or None
        # for the MLX ops; KernelChoices.page_key_chunk_write): one launch where a 2K chunk took
        # ~700 MLX ops (docs/lab/benchmarks-kv-page-keys.md, device run 10).
        self.chunk_writer = (chunk_writer if chunk_writer is not None and not self.cpu_writes
                             and self.tails is not None and chunk_writer.serves(self) else None)

    def write(self, slots: Slots, k: mx.array, v: mx.array) -> None:
        """Values quantized per row; keys go to the native tail, or to codes when a page fills."""
        self.flush_tail()   # the previous step's tail rows: a page filled now needs them
        if self.chunk_writer is not None and self._pages_consecutive(slots):
            self._write_chunk(slots, k, v)
            return
        parts = (cpu_page_key_write.value_record_parts(v, self.fmt.v_bits, GROUP_SIZE)
                 if self.cpu_writes else list(quantize(v, self.fmt.v_bits)))
        self.layout.write_rows(self.pool, self._row_index(slots, V_SECTIONS),
                               record(parts, V_SECTIONS))
        plan = self._tail_plan(slots)
        fill = self._fill_plan(slots)
        if fill is not None:
            self._quantize_filled(fill, k)
        if plan.rows is not None:
            self._pending = self._tail_rows_of(slots, plan, k, v)

    @staticmethod
    def _pages_consecutive(slots: Slots) -> bool:
        """Whether each page's rows are one run of consecutive rows (what the write kernel
        assumes when it keys a filled page from the call's rows): true of every step the
        runner builds (a sequence's rows in position order)."""
        key = "page_runs_consecutive"
        if key not in slots._by_heads:
            slots._by_heads[key] = len(slots.runs()) == len(np.unique(slots.page_np))
        return slots._by_heads[key]

    def _write_chunk(self, slots: Slots, k: mx.array, v: mx.array) -> None:
        """`write` through the CUDA write kernel: the step's tail plan (shared by every layer)
        says which rows go to which tail slot (-1: their page fills now); each row carries its
        page's slot as the step began, where a filled page's earlier rows are. The tails are
        written in place unless the plan handed a given-back slot to a new page (`reused`:
        engine/kv/tails.py), then as new arrays adopted after attention read the old ones
        (`flush_tail`)."""
        plan = self._tail_plan(slots)
        self._fill_plan(slots)   # refuses a page that fills with no native copy of its start
        key = ("page_key_chunk_slots", id(self.tails))
        if key not in slots._by_heads:
            before = self.tails.before
            tb = np.array([before.get(p, -1) for p in slots.page_np.tolist()], np.int32)
            tw = np.full(slots.count, -1, np.int32)
            if plan.rows is not None:
                tw[plan.rows] = plan.slots
            slots._by_heads[key] = (mx.array(tb), mx.array(tw))
        tail_before, tail_write = slots._by_heads[key]
        self.pool, self._written_tail = self.chunk_writer.write_decode(
            k, v, self.pool, self.layout, self.fmt.k_bits, self.tail, slots.page, slots.offset,
            tail_before, tail_write, in_place=not plan.reused)

    def write_decode(self, slots, keys: mx.array, values: mx.array) -> None:
        """One token per row ([N, heads, 1, dim]): `write`, or inside a compiled step (slots
        carrying the step's tail slots) `_write_planned`."""
        n, h, _, d = keys.shape
        k, v = keys.reshape(n, h, d), values.reshape(n, h, values.shape[-1])
        if slots.tail_write is None:
            self.write(slots, k, v)
        else:
            self._write_planned(slots, k, v)

    def _write_planned(self, slots, k: mx.array, v: mx.array) -> None:
        """A decode write from device arrays only: values quantized per row; every row's page
        keyed from its tail rows (slot as the step began) with the new row at its offset, all
        of its rows when this one is the page's last; the new rows to their tail slots after
        attention (`flush_tail`). CUDA (`slots.page_key_writer`, KernelChoices.page_key_write):
        all of it in one kernel launch (engine/attention/cuda/page_key_write.py), which keys a
        page only in the step that fills it and writes the tails in place (a compiled step
        never runs a plan that handed a given-back slot to a new page: CompiledDecode.forward),
        handed back made to depend on the write and adopted after attention (`flush_tail`)."""
        self.flush_tail()
        writer = slots.page_key_writer
        if writer is not None and writer.serves(self):
            self.pool, self._written_tail = writer.write_decode(
                k, v, self.pool, self.layout, self.fmt.k_bits, self.tail, slots.page,
                slots.offset, slots.tail_before, slots.tail_write)
            return
        self.layout.write_rows(self.pool, self._row_index(slots, V_SECTIONS),
                               record(list(quantize(v, self.fmt.v_bits)), V_SECTIONS))
        n, t = k.shape[0], self.page_tokens
        page = self.tail[0][mx.maximum(slots.tail_before, 0)].astype(mx.float32)
        page[mx.arange(n), slots.offset] = k.astype(mx.float32)
        codes, scales, offsets = quantize_pages(page.transpose(0, 2, 1, 3), self.fmt.k_bits)
        for name, values in zip(K_SECTIONS, (codes.transpose(0, 2, 1, 3), meta_rows(scales, t),
                                             meta_rows(offsets, t))):
            self.layout.write_pages(self.pool, slots.page, name, values)
        self._pending = (slots.tail_write, slots.offset, k, v)

    def flush_tail(self) -> None:
        """The fused write's tails (`_write_planned`, CUDA) replace the old ones once the
        step's attention has read those; else PackedLayerStore's pending tail rows."""
        if self._written_tail is not None:
            self.tail, self._written_tail = self._written_tail, None
        super().flush_tail()

    @property
    def can_trace(self) -> bool:
        """A compiled decode step may stand in for this store: it plans the tails on the host
        and the write takes them as device arrays (`write_decode`)."""
        return not self.sink_rows

    @property
    def decode_writes_own(self) -> bool:
        return False   # no kernel stores page-key rows itself

    def adopt(self, arrays: list[mx.array]) -> None:
        """Hold `arrays` (a compiled step's written pool and tail pool) from now on."""
        self.pool, *tail = arrays
        self.tail = tuple(tail)

    def plan_step(self, slots: Slots) -> None:
        """The tail plan, then the page fills it decides (`PackedLayerStore.plan_step`)."""
        super().plan_step(slots)
        if self.tails is not None:
            self._fill_plan(slots)

    def _fill_plan(self, slots: Slots) -> FillPlan | None:
        key = ("page_key_fill", id(self.tails))
        if key not in slots._by_heads:   # shared by every layer of the step, like the tail plan
            slots._by_heads[key] = self._make_fill_plan(slots.page_np, slots.offset_np)
        return slots._by_heads[key]

    def _make_fill_plan(self, page: np.ndarray, offset: np.ndarray) -> FillPlan | None:
        t = self.page_tokens
        pages = np.unique(page[offset == t - 1])
        if not pages.size:
            return None
        rows = np.flatnonzero(np.isin(page, pages))
        sources = []
        for p in pages.tolist():
            first = int(offset[page == p].min())
            slot = self.tails.before.get(p, -1)   # the map as this step began
            if first > 0 and slot < 0:
                raise KVFormatError(f"page {p} fills, but its first {first} rows have no "
                                    "native copy to quantize from")
            sources.append(max(slot, 0))   # a page written whole reads no tail row
        return FillPlan(pages.astype(np.int32), rows.astype(np.int32),
                        np.searchsorted(pages, page[rows]).astype(np.int32),
                        offset[rows].astype(np.int32), np.asarray(sources, dtype=np.int32))

    def _quantize_filled(self, fill: FillPlan, k: mx.array) -> None:
        """Key codes and per-channel metadata of the pages this write fills."""
        t = self.page_tokens
        if self.cpu_writes:
            sections = cpu_page_key_write.filled_page_keys(
                self.tail[0], *fill.host, k, self.fmt.k_bits)
        else:
            page = self.tail[0][fill.sources].astype(mx.float32)   # [F, T, H, D] earlier rows
            page[fill.where, fill.offsets] = k[fill.rows].astype(mx.float32)
            codes, scales, offsets = quantize_pages(page.transpose(0, 2, 1, 3), self.fmt.k_bits)
            sections = (codes.transpose(0, 2, 1, 3), meta_rows(scales, t), meta_rows(offsets, t))
        for name, values in zip(K_SECTIONS, sections):
            self.layout.write_pages(self.pool, fill.pages, name, values)

    def read_packed(self, slots: Slots) -> tuple[Packed, Packed]:
        """As stored; key rows of a partial page (no codes yet: the checkpoint carries them
        native) read as zeros, never the stale codes of the page's previous owner."""
        self.flush_tail()
        kp, vp = super().read_packed(slots)
        partial = np.isin(slots.page_np, list(self.tails.slot_of))
        if partial.any():
            mask = mx.array(partial)[:, None, None]
            kp = Packed(*(mx.where(mask, mx.zeros_like(a), a) for a in kp))
        return kp, vp

    def gather_packed(self, pages: mx.array) -> PackedKV:
        """History for page tables [B, P]: whole pages, keys as PagePacked, values packed."""
        lay = self.layout
        keys = PagePacked(lay.gather(self.pool, pages, "k_codes"),
                          *(meta_pages(lay.gather_pages(self.pool, pages, n))
                            for n in K_SECTIONS[1:]))
        return PackedKV(keys, Packed(*(lay.gather(self.pool, pages, n) for n in V_SECTIONS)))

    def gather(self, pages: mx.array) -> tuple[mx.array, mx.array]:
        """Dequantized K and V, [B, heads, P*page_tokens, dim]; a partial tail page is its native
        copy (what attention reads)."""
        self.flush_tail()
        hist = self.gather_packed(pages)
        k = dequantize_pages(hist.k, self.fmt.k_bits)
        v = dequantize(hist.v, self.fmt.v_bits)
        if self.tails.slot_of:
            k, v = self._with_tails(np.array(pages), k, v)
        return k, v
