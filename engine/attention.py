"""Paged attention behind mlx-lm's own cache protocol, so unmodified model code runs on pages.

mlx-lm attention does `q = rope(q, offset=cache.offset)`, `k, v = cache.update_and_fetch(k, v)`,
then `scaled_dot_product_attention(q, k, v, cache=cache, mask=mask, sinks=...)`, and the model
builds masks once per forward with `cache.make_mask(...)` on one full and one sliding layer.
`PagedLayerCache` answers those calls: it writes the new K/V into pages by slot and returns the
row's pages gathered into a padded batch plus a mask that hides padding, future positions and
(for sliding layers) keys older than the window. Attention sinks (gpt_oss) pass straight through
to `mx.fast.scaled_dot_product_attention`.

Rows are right-padded to the longest chunk of the forward call. Everything index-like (slots,
page lists, masks) is built once per call in `StepBatch` and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.kvstore import LayerStore, Slots


@dataclass(frozen=True)
class Row:
    start: int              # tokens of this sequence already in KV
    length: int             # new tokens in this call
    page_table: list[int]   # covers start + length tokens


@dataclass
class View:
    """The keys a group of layers sees: gathered pages plus how to slice and mask them."""

    window: int | None
    pages: mx.array                 # [B, P] physical page ids (padding points at a live page)
    base: np.ndarray                # [B] position of the first gathered key of each row
    key_slice: tuple[int, int] | None = None   # single-row calls: exact key range to keep
    masks: dict | None = None


class StepBatch:
    """Per-forward indices shared by all layers: slots to write, pages to gather, masks."""

    def __init__(self, rows: list[Row], page_tokens: int):
        self.rows = rows
        self.page_tokens = page_tokens
        self.size = len(rows)
        self.width = max(r.length for r in rows)
        starts = np.array([r.start for r in rows], dtype=np.int64)
        lengths = np.array([r.length for r in rows], dtype=np.int64)
        self.starts, self.lengths = starts, lengths
        # RoPE positions: an int for one row (as mlx-lm does), per-row offsets for a batch.
        self.offset = int(starts[0]) if self.size == 1 else mx.array(starts.astype(np.int32))
        self.slots = Slots.from_flat(self._slot_ids(), page_tokens)
        # Padded positions produce K/V too; keep only real tokens when any row is padded.
        padded = np.arange(self.width)[None, :] < lengths[:, None]
        self.valid = None if padded.all() else mx.array(np.flatnonzero(padded).astype(np.int32))
        self._views: dict[int | None, View] = {}

    def _slot_ids(self) -> np.ndarray:
        out = []
        t = self.page_tokens
        for r in self.rows:
            pos = np.arange(r.start, r.start + r.length)
            out.append(np.asarray(r.page_table, dtype=np.int64)[pos // t] * t + pos % t)
        return np.concatenate(out)

    def view(self, window: int | None) -> View:
        if window not in self._views:
            self._views[window] = self._build_view(window)
        return self._views[window]

    def _build_view(self, window: int | None) -> View:
        t = self.page_tokens
        ends = self.starts + self.lengths
        if window is None:
            first = np.zeros(self.size, dtype=np.int64)
        else:  # the first query of the row needs keys from start - window + 1 on
            first = np.maximum(self.starts - window + 1, 0) // t
        last = (ends - 1) // t + 1
        width = int((last - first).max())
        pages = np.zeros((self.size, width), dtype=np.int32)
        for i, r in enumerate(self.rows):
            row = r.page_table[first[i]:last[i]]
            pages[i, :len(row)] = row
            pages[i, len(row):] = row[0]  # any live page; the mask hides it
        base = first * t
        key_slice = None
        if self.size == 1:
            lo = 0
            if window is not None and self.lengths[0] == 1:
                lo = max(int(ends[0]) - window, 0) - int(base[0])
            key_slice = (lo, int(ends[0] - base[0]))
        return View(window, mx.array(pages), base, key_slice, {})

    def mask(self, view: View, window: int | None):
        """The mask for queries of this call against `view`'s keys; cached per window."""
        if window in view.masks:
            return view.masks[window]
        n = int(self.lengths[0])
        if view.key_slice is not None and window == view.window and (window is None or n == 1):
            # One row, exact key range: the same mask mlx-lm's own caches produce.
            mask = None if n == 1 else "causal"
        else:
            mask = self.array_mask(view, window)
        view.masks[window] = mask
        return mask

    def array_mask(self, view: View, window: int | None) -> mx.array:
        keys = int(view.pages.shape[1]) * self.page_tokens
        if view.key_slice is not None:
            lo, hi = view.key_slice
            key_pos = view.base[:, None] + np.arange(lo, hi)[None, :]
        else:
            key_pos = view.base[:, None] + np.arange(keys)[None, :]
        # Padded queries reuse their row's last real position so no query row is fully masked.
        q_pos = self.starts[:, None] + np.minimum(np.arange(self.width)[None, :],
                                                  self.lengths[:, None] - 1)
        q = mx.array(q_pos.astype(np.int32))[:, None, :, None]
        k = mx.array(key_pos.astype(np.int32))[:, None, None, :]
        mask = k <= q
        if window is not None:
            mask = mask & (k > q - window)
        return mask


class PagedLayerCache:
    """mlx-lm cache protocol for one layer over one forward call: write pages, return views."""

    def __init__(self, store: LayerStore, step: StepBatch, window: int | None):
        self.store = store
        self.step = step
        self.view = step.view(window)
        self.offset = step.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, n, d = keys.shape
        k = keys.transpose(0, 2, 1, 3).reshape(b * n, h, d)
        v = values.transpose(0, 2, 1, 3).reshape(b * n, h, values.shape[-1])
        if self.step.valid is not None:
            k, v = k[self.step.valid], v[self.step.valid]
        self.store.write(self.step.slots, k, v)
        k, v = self.store.gather(self.view.pages)
        if self.view.key_slice is not None:
            lo, hi = self.view.key_slice
            k, v = k[:, :, lo:hi], v[:, :, lo:hi]
        return k, v

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        window = window_size or self.view.window
        if return_array:
            return self.step.array_mask(self.view, window)
        return self.step.mask(self.view, window)
