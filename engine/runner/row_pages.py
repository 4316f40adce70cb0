"""Each decoding sequence's page ids as an int32 array, kept from one compiled step to the next.

Why: a compiled decode step uploads every row's page table (engine/runner/compiled_decode.py).
Converting every row's Python list to numpy and range-checking it each step is host work that
grows with the context (a 32K row holds thousands of pages) while the device's share of a packed
step shrinks, so on a GPU it sets the step time; kept here, each id is converted and checked once
(numbers: docs/lab/engine-runner-notes.md).

A sequence's page list only grows by appending: `PageTable` appends the ids it allocates and gives
a released or replaced table a new list (engine/kv/pages.py), and `Chunk` (engine/sched/seq.py)
states the same contract for any caller. So a row's array is extended by the ids appended since its
last step, and those are range-checked once, when they arrive. A different list object for the
sequence (a new table) starts its array over; a sequence missing from a step is dropped, and
converted afresh if it comes back.
"""
from __future__ import annotations

import numpy as np


class _Row:
    __slots__ = ("source", "ids", "n")

    def __init__(self, source: list[int]):
        self.source = source    # the caller's list (held, so its id cannot be reused)
        self.ids = np.empty(0, dtype=np.int32)
        self.n = 0               # leading entries of `source` copied into `ids`


class RowPages:
    """`arrays(chunks, need)`: each chunk's first need[i] page ids as an int32 array."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._rows: dict[int, _Row] = {}
        self.converted = 0   # page ids converted from lists so far (tests read it)

    def arrays(self, chunks, need: list[int]) -> list[np.ndarray]:
        rows: dict[int, _Row] = {}
        out = []
        for c, n in zip(chunks, need):
            row = self._rows.get(c.seq_id)
            if row is None or row.source is not c.page_table or len(c.page_table) < row.n:
                row = _Row(c.page_table)
            if row.n < n:
                self._extend(c.seq_id, row, n)
            rows[c.seq_id] = row
            out.append(row.ids[:n])
        self._rows = rows
        return out

    def _extend(self, seq_id: int, row: _Row, n: int) -> None:
        new = np.asarray(row.source[row.n:n], dtype=np.int64)
        if new.min() < 0 or new.max() >= self.num_pages:
            raise ValueError(f"sequence {seq_id}: page id out of range")
        if n > len(row.ids):   # grow by doubling: one copy per doubling, not per page
            grown = np.empty(max(n, 2 * len(row.ids)), dtype=np.int32)
            grown[:row.n] = row.ids[:row.n]
            row.ids = grown
        row.ids[row.n:n] = new
        row.n = n
        self.converted += len(new)
