"""Prefix reuse: full KV pages found again by content, shared by refcount. No MLX.

A page's key is a hash chain: h_0 = root, h_i = sha256(h_{i-1} | tokens of page i). The root
binds the KV storage identity (per-layer formats), the model fingerprint, the tenant namespace
and the page size, so two requests can share a page only if the same model wrote the same tokens
in the same format for the same tenant: native and packed pages, or two tenants' pages, never
alias. Only full pages are cached (a partly filled tail page is still being written), and a hit
always leaves at least the last prompt token to compute, because its logits are needed. The chain
runs over token ids, prompt or generated alike: a finished request's reply pages (published by the
scheduler at reclaim) continue its prompt's chain, so a chat's next turn that resends the history
hits them; a template that re-tokenizes the reply differently only misses, it never mismatches.

The cache holds one pool reference per cached page; a hit adds the request's own reference, so
a shared page is allocated (and charged) once. Eviction frees leaves (pages no longer held by any
request and with no cached continuation), keeping every chain walkable, the one expected back last
first (engine/kv/reuse.py: each page learns its chain's reuse interval from the lookups that hit
it; LRU would evict the conversation due back next).

Each entry keeps its page's token ids and its chain's root, so the cache can be handed to another
replica (`entries()`, engine/checkpoint/prefix_pages.py): the receiver recomputes every hash from
its own root, never trusting the sender's. `root_tenant` names the tenant of a root this process
computed (the root is a one-way hash; the export names its tenants).
"""
from __future__ import annotations

import hashlib
import heapq
import time
from dataclasses import dataclass
from typing import Callable

from engine.kv.pages import PagePool
from engine.kv.reuse import Candidate, ReuseIntervals, eviction_key, smoothed

_TENANTS: dict[bytes, str] = {}   # chain root -> tenant, for roots this process computed


def chain_root(storage_identity: str, model_fingerprint: str, tenant: str,
               page_tokens: int) -> bytes:
    for name, value in (("storage identity", storage_identity),
                        ("model fingerprint", model_fingerprint), ("tenant", tenant)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"prefix chain root needs a non-empty {name}")
    text = "\x1f".join(["orchard-prefix-v1", storage_identity, model_fingerprint, tenant,
                        str(page_tokens)])
    root = hashlib.sha256(text.encode()).digest()
    _TENANTS[root] = tenant
    return root


def root_tenant(root: bytes) -> str | None:
    """The tenant of a chain root computed by `chain_root` in this process (None if unknown)."""
    return _TENANTS.get(root)


def page_hashes(root: bytes, token_ids: list[int], page_tokens: int) -> list[bytes]:
    """Chain hashes of every full page of token_ids."""
    out, h = [], root
    for start in range(0, len(token_ids) - page_tokens + 1, page_tokens):
        page = token_ids[start:start + page_tokens]
        h = hashlib.sha256(h + b"".join(int(t).to_bytes(8, "little", signed=True)
                                        for t in page)).digest()
        out.append(h)
    return out


@dataclass
class _Entry:
    page: int
    parent: bytes | None
    last_used: int              # the cache's use counter: orders uses
    root: bytes
    tokens: tuple[int, ...]
    used_s: float = 0.0         # clock time of the last use: measures reuse intervals
    gap_s: float | None = None  # this page's smoothed reuse interval (engine/kv/reuse.py)
    fresh: bool = True          # published and not looked up since: the next hit is a reuse
    children: int = 0


@dataclass(frozen=True)
class CachedPage:
    """One cached page as `PrefixCache.entries` lists it (parents before children)."""

    key: bytes
    parent: bytes | None
    root: bytes
    tokens: tuple[int, ...]
    page: int


class PrefixCache:
    """Content-addressed full pages over one PagePool."""

    def __init__(self, pool: PagePool, clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self._entries: dict[bytes, _Entry] = {}
        self._clock = 0
        self._now = clock          # seconds; injectable so a model or a test runs its own time
        self._intervals = ReuseIntervals()
        self.queries = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def typical_reuse_s(self) -> float | None:
        """The median of the recent reuse intervals (None before the first reuse)."""
        return self._intervals.typical()

    def entries(self) -> list[CachedPage]:
        """Every cached page, each after its parent (a parent outlives its children and is
        inserted first, so the dict's order already is one)."""
        return [CachedPage(h, e.parent, e.root, e.tokens, e.page)
                for h, e in self._entries.items()]

    def lookup(self, root: bytes, token_ids: list[int]) -> list[int]:
        """Pages of the longest cached prefix (leaving >= 1 token to compute), now shared by
        the caller, who frees them with the rest of its page table."""
        self.queries += 1
        pages = []
        for h in page_hashes(root, token_ids[:-1], self.pool.page_tokens):
            entry = self._entries.get(h)
            if entry is None:
                break
            pages.append(entry)
        self._clock += 1
        now = self._now()
        # A reuse interval runs from a page's publication to the first lookup that finds it
        # again: a request waiting for room looks its prefix up once per admission attempt,
        # and those retries are one reuse, not many of a few milliseconds each.
        if pages and pages[-1].fresh:   # the deepest page hit: how long its chain sat idle
            self._intervals.observe(now - pages[-1].used_s)
        for entry in pages:
            if entry.fresh:
                entry.gap_s = smoothed(entry.gap_s, now - entry.used_s)
            entry.last_used, entry.used_s, entry.fresh = self._clock, now, False
        found = [e.page for e in pages]
        self.pool.share(found)
        if found:
            self.hits += 1
            self.hit_tokens += len(found) * self.pool.page_tokens
        return found

    def insert(self, root: bytes, token_ids: list[int], page_table: list[int]) -> int:
        """Register the full pages of a request whose KV for token_ids (its prompt, or prompt +
        output up to the last token with K/V) is written by retired steps.

        Returns how many pages were newly cached; already-cached content is not duplicated.
        """
        added = 0
        parent = None
        self._clock += 1
        now = self._now()
        t = self.pool.page_tokens
        for i, h in enumerate(page_hashes(root, token_ids, t)):
            entry = self._entries.get(h)
            if entry is None:
                self.pool.share([page_table[i]])
                # a new page continues its chain, at its chain's pace (a reply, its conversation's)
                gap = None if parent is None else self._entries[parent].gap_s
                entry = self._entries[h] = _Entry(page_table[i], parent, self._clock, root,
                                                  tuple(token_ids[i * t:(i + 1) * t]), now, gap)
                if parent is not None:
                    self._entries[parent].children += 1
                added += 1
            entry.last_used, entry.used_s, entry.fresh = self._clock, now, True
            parent = h
        return added

    def evict(self, pages_wanted: int) -> int:
        """Free up to `pages_wanted` pages held only by the cache, leaves expected back last
        first (engine/kv/reuse.py). Keys are taken once per call (one clock reading), so a heap
        orders them; a parent left childless joins it."""
        now, typical = self._now(), self._intervals.typical()
        heap = [(eviction_key(self._candidate(e), now, typical), h)
                for h, e in self._entries.items() if self._evictable(e)]
        heapq.heapify(heap)
        freed = 0
        while freed < pages_wanted and heap:
            _, h = heapq.heappop(heap)
            entry = self._entries.pop(h)
            if entry.parent is not None:
                parent = self._entries[entry.parent]
                parent.children -= 1
                if self._evictable(parent):
                    heapq.heappush(heap, (eviction_key(self._candidate(parent), now, typical),
                                          entry.parent))
            self.pool.free([entry.page])
            freed += 1
        return freed

    def _evictable(self, e: _Entry) -> bool:
        return e.children == 0 and self.pool.refcount(e.page) == 1

    def _candidate(self, e: _Entry) -> Candidate:
        parent = None if e.parent is None else self._entries[e.parent]
        return Candidate(e.last_used, e.used_s, e.gap_s,
                         superseded=parent is not None and parent.last_used > e.last_used)

    def clear(self) -> None:
        """Drop every cache reference (engine shutdown or format change)."""
        for entry in self._entries.values():
            self.pool.free([entry.page])
        self._entries.clear()
