"""Page bookkeeping: ids, refcounts and a free list. No MLX, no arrays.

The KV store owns `num_pages` physical pages of `page_tokens` token slots each; this module only
decides which page ids a request holds. A pool may start with only its first `allocated` ids
backed by memory and grow by slabs when an allocation needs more (`grow`): the id space and every
count callers see (`num_free`, `num_used`) are the whole pool's from the start, so admission and
eviction decide exactly as with a pool allocated whole; only the memory is taken later (a
replacement replica's start-up does not wait for gigabytes of zeroed KV: docs/reliability.md). A request's page table grows by appending ids, so live
KV is never copied. Refcounts exist so later prefix sharing can map one page into several tables;
a page returns to the free list only when its last holder frees it, and freeing a page nobody
holds is an error (a double free is always an engine bug, so it raises instead of being ignored).
"""
from __future__ import annotations

from collections import deque

from engine.errors import PageError

# Default page size, chosen by measurement (docs/lab/engine-notes.md).
# In-place decode issues one small matmul per (row, KV head, page), so small pages pay call
# overhead at long context; 128 gains nothing over 64 but doubles the tail (<= 63 idle slots per
# sequence at 64). Hence 64.
DEFAULT_PAGE_TOKENS = 64


class GrowthFailed(PageError):
    """The pool's memory could not be grown (the store's `grow` raised): the caller may free
    pages or turn the request that needed them away; the pool is unchanged."""


def pages_for(tokens: int, page_tokens: int) -> int:
    """Whole pages needed for `tokens` token slots (tails count as a full page)."""
    return -(-max(tokens, 0) // page_tokens)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def grow_target(allocated: int, missing: int, num_pages: int) -> int:
    """Pages to hold after a growth that must add at least `missing`: double, so a pool that
    grows to N pages copies and zeroes O(N) in O(log N) growths, never past `num_pages`."""
    return min(num_pages, max(allocated + missing, 2 * allocated))


class PagePool:
    """Fixed set of page ids with refcounts and a FIFO free list.

    `allocated`: how many ids (the first ones) are backed by memory now (default: all);
    `grow(n)` is called to back the first `n` before any id past them is handed out. It runs
    where `allocate` runs (the engine thread) and must either back them or raise, leaving the
    pool unchanged."""

    def __init__(self, num_pages: int, page_tokens: int, on_free=None, *,
                 allocated: int | None = None, grow=None):
        if num_pages < 1:
            raise PageError(f"a page pool needs at least one page, got {num_pages}")
        if not is_power_of_two(page_tokens):
            raise PageError(f"page_tokens must be a power of two, got {page_tokens}")
        allocated = num_pages if allocated is None else allocated
        if not 1 <= allocated <= num_pages:
            raise PageError(f"allocated pages must be in [1, {num_pages}], got {allocated}")
        if allocated < num_pages and grow is None:
            raise PageError(f"{allocated} of {num_pages} pages allocated and no way to grow")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.allocated = allocated
        self._grow = grow
        self._refs = [0] * allocated
        # FIFO: a freed page is reused last, which later keeps cached prefixes alive longest.
        self._free: deque[int] = deque(range(allocated))
        # Called with the pages a `free` returned to the free list (the KV store drops state
        # kept per page outside the pages themselves: native tails, engine/kv/tails.py).
        self.on_free = on_free

    @property
    def num_free(self) -> int:
        """Pages an allocation may still take: free ones and those not allocated yet."""
        return len(self._free) + self.num_pages - self.allocated

    @property
    def num_free_backed(self) -> int:
        """Free pages already backed by memory: an allocation of at most this many never grows."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.allocated - len(self._free)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (refcount 1 each); all or nothing (GrowthFailed when the pool
        had to grow for them and could not)."""
        if n < 0:
            raise PageError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise PageError(f"out of pages: asked {n}, {self.num_free} free of {self.num_pages}")
        if n > len(self._free):
            self._grow_by(n - len(self._free))
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def back(self, pages: int) -> None:
        """Back the first `pages` ids (at most `num_pages`) with memory now, growing as `allocate`
        would; raises GrowthFailed, leaving the pool unchanged, if the memory cannot be had. The
        scheduler calls it at admission, where a failure can turn the request away, so that the
        allocations of the steps that follow need no growth."""
        pages = min(pages, self.num_pages)
        if pages > self.allocated:
            self._grow_by(pages - self.allocated)

    def _grow_by(self, missing: int) -> None:
        target = grow_target(self.allocated, missing, self.num_pages)
        try:
            self._grow(target)
        except Exception as exc:  # noqa: BLE001 - MLX reports a failed allocation as it may
            raise GrowthFailed(f"could not grow the KV pool from {self.allocated} to {target} "
                               f"pages: {type(exc).__name__}: {exc}") from exc
        self._refs.extend([0] * (target - self.allocated))
        # New pages go after the free ones: the FIFO order (cached prefixes reused last) holds.
        self._free.extend(range(self.allocated, target))
        self.allocated = target

    def share(self, pages: list[int]) -> None:
        """Add one holder to pages already in use (prefix sharing)."""
        for p in pages:
            self._check_id(p)
            if self._refs[p] == 0:
                raise PageError(f"cannot share free page {p}")
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one holder from each page; pages with no holder left return to the free list.

        Validated before any change so a bad call leaves the pool untouched.
        """
        drops: dict[int, int] = {}
        for p in pages:
            self._check_id(p)
            drops[p] = drops.get(p, 0) + 1
            if drops[p] > self._refs[p]:
                raise PageError(f"double free of page {p} (refcount {self._refs[p]})")
        gone = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                gone.append(p)
        if gone and self.on_free is not None:
            self.on_free(gone)

    def check_consistent(self) -> None:
        """Free list and refcounts agree (used by tests and debug assertions)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise PageError("a page is on the free list twice")
        for p, r in enumerate(self._refs):
            if r < 0 or (r == 0) != (p in free):
                raise PageError(f"page {p}: refcount {r} disagrees with the free list")

    def _check_id(self, page: int) -> None:
        if not (isinstance(page, int) and 0 <= page < self.allocated):
            raise PageError(f"unknown page id {page!r}")


class PageTable:
    """One request's pages in token order; grows by appending ids, never by copying."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.pages: list[int] = []

    @property
    def capacity_tokens(self) -> int:
        return len(self.pages) * self.pool.page_tokens

    def ensure(self, tokens: int) -> list[int]:
        """Grow to hold `tokens` token slots; return the newly appended page ids."""
        need = pages_for(tokens, self.pool.page_tokens) - len(self.pages)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        self.pages.extend(new)
        return new

    def slot(self, position: int) -> int:
        """Physical token slot (page * page_tokens + offset) of a token position."""
        pt = self.pool.page_tokens
        return self.pages[position // pt] * pt + position % pt

    def release(self) -> None:
        """Give every page back to the pool; the table is empty afterwards."""
        pages, self.pages = self.pages, []
        self.pool.free(pages)
