"""Which pages are some sequence's partial last page, and which native tail slot holds each.

Formats with a native tail (capacity.formats, int4-tail) keep the page a sequence is still filling
in the model's dtype, in a pool of `slots` native pages per layer (one per running sequence). This
is the bookkeeping every layer of one KVStore shares: no MLX, ids only.

A write's rows decide the map once per step (`plan`): a page whose last offset was written is full
and gives its slot back; a page written but not full keeps its slot or takes a free one. Attention
in that step still reads the tails as they were before the step (`before`): a page that a step
completes was partial when the step began, and its rows are read native, as the sequence's tail.
Each layer writes the new native rows after its attention (engine.kv.packed_store), so a
slot handed from a page that filled to a new page is never overwritten before it was read; and
such a hand-over waits for a later step while another slot is free (`plan`), so the CUDA write
kernel can write the tails in place, before attention.
Pages freed by the page pool give their slots back (`release`).
"""
from __future__ import annotations

import numpy as np

from capacity.formats import KVFormatError

SMALL_WRITE = 64   # rows up to which `plan` works on Python ids rather than numpy arrays


class TailPlan:
    """One step's tail bookkeeping, computed once and shared by every layer."""

    def __init__(self, rows: np.ndarray | None, slots: np.ndarray | None,
                 reused: bool = False):
        self.rows = rows      # indices of the step's rows that land in a partial page
        self.slots = slots    # their native slot, per row
        self.reused = reused  # a slot a page filled by this write gave back taken again


class TailMap:
    """page id -> native tail slot, for the pages that are some sequence's partial last page."""

    def __init__(self, slots: int, page_tokens: int):
        if slots < 1:
            raise KVFormatError("a native-tail format needs at least one tail slot (one per "
                                "running sequence); got none")
        self.num_slots = slots
        self.page_tokens = page_tokens
        self.slot_of: dict[int, int] = {}
        self.before: dict[int, int] = {}
        self._free = list(range(slots - 1, -1, -1))   # pop() hands out slot 0 first
        self.reused = False   # the last plan's: see `plan`

    @property
    def used(self) -> int:
        return len(self.slot_of)

    def plan(self, page: np.ndarray, offset: np.ndarray) -> TailPlan:
        """Update the map for a write of rows at (page, offset) and say where their native copies
        go. Rows of pages the write fills (their last offset is among the rows) need none.

        Slots the write's filled pages give back are handed out again only by later plans
        while any other slot is free: a kernel that writes the tails in place
        (engine/attention/cuda/page_key_write.py) may then write a new page's rows in the same
        launch that reads the filled page's rows, and the step's attention reads them too.
        Where no other slot is free one of them is taken all the same (`reused`): such a step
        must write its tails after attention, or as new arrays."""
        self.before = dict(self.slot_of)
        self.reused = False
        page, offset = np.asarray(page), np.asarray(offset)
        if page.size == 0:
            return TailPlan(None, None)
        last = self.page_tokens - 1
        small = page.size <= SMALL_WRITE
        if small:
            # A decode step's rows: sets over a few ids cost less than numpy's calls (its
            # unique / isin took ~20 us a step, on the host path of every compiled step).
            ids, offs = page.tolist(), offset.tolist()
            full = sorted({p for p, o in zip(ids, offs) if o == last})
            partial = sorted(set(ids).difference(full))
        else:
            full = np.unique(page[offset == last]).tolist()
            partial = np.setdiff1d(page, full).tolist()
        given_back = [s for s in (self.slot_of.pop(p, None) for p in full) if s is not None]
        for p in partial:
            if p not in self.slot_of:
                self.slot_of[p] = self._take(given_back)
        self._free.extend(given_back)
        if not partial:
            return TailPlan(None, None)
        if small:
            wanted = set(partial)
            keep = np.array([i for i, p in enumerate(ids) if p in wanted], dtype=np.int64)
        else:
            keep = np.flatnonzero(np.isin(page, partial))
        return TailPlan(keep.astype(np.int32),
                        np.array([self.slot_of[int(p)] for p in page[keep]], dtype=np.int32),
                        self.reused)

    def _take(self, given_back: list[int]) -> int:
        """A free slot, one given back by this plan only when no other is free."""
        if self._free:
            return self._free.pop()
        if given_back:
            self.reused = True
            return given_back.pop()
        raise KVFormatError(
            f"native tail pool exhausted: {self.num_slots} slots, all held by "
            "partial pages (more running sequences than the pool was sized for)")

    def decode_slots(self, page: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """`plan` for a decode step (one row per sequence, at (page, offset)) whose stores cannot
        plan inside it (a compiled step): [2, rows] int32, each row's slot as the step began
        (-1: none, at a page's first offset; attention reads it) and the slot its new row is
        written to (for a page this row fills: the slot it just gave back, never read again).
        `reused` after it: whether a new page took a slot a filling row gave back (the tails
        must then not be written in place: `plan`)."""
        self.plan(page, offset)
        out = np.empty((2, len(page)), dtype=np.int32)
        for i, (p, o) in enumerate(zip(page.tolist(), offset.tolist())):
            if o and p not in self.before:
                raise KVFormatError(f"page {p} holds a partial tail with no native copy")
            out[0, i] = self.before[p] if o else -1
            out[1, i] = self.slot_of.get(p, self.before.get(p, -1))
        return out

    def state(self) -> tuple:
        """The map's bookkeeping, for `restore` when a planned step does not run."""
        return dict(self.slot_of), dict(self.before), list(self._free)

    def restore(self, state: tuple) -> None:
        slot_of, before, free = state
        self.slot_of, self.before, self._free = dict(slot_of), dict(before), list(free)

    def claim(self, page: int) -> int:
        """The slot of `page`, taking a free one if it has none (checkpoint restore)."""
        if page not in self.slot_of:
            if not self._free:
                raise KVFormatError(f"native tail pool exhausted: {self.num_slots} slots")
            self.slot_of[page] = self._free.pop()
        return self.slot_of[page]

    def release(self, pages) -> None:
        """Pages returned to the free list: their tails (if any) are gone."""
        for p in pages:
            s = self.slot_of.pop(int(p), None)
            if s is not None:
                self._free.append(s)

    def tails_before(self, pages_np: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Per row, the slot holding its tail page when the step began (-1: none): the page at
        position `start` of each row's table when `start` is not on a page boundary."""
        t = self.page_tokens
        out = np.full(len(starts), -1, dtype=np.int32)
        for i, s in enumerate(starts):
            if s % t:
                page = int(pages_np[i, s // t])
                if page not in self.before:
                    raise KVFormatError(f"page {page} holds a partial tail with no native copy")
                out[i] = self.before[page]
        return out
