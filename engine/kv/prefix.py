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
a shared page is allocated (and charged) once. Eviction frees least recently used leaves (pages
no longer held by any request and with no cached continuation), keeping every chain walkable.

Each entry keeps its page's token ids and its chain's root, so the cache can be handed to another
replica (`entries()`, engine/checkpoint/prefix_pages.py): the receiver recomputes every hash from
its own root, never trusting the sender's. `root_tenant` names the tenant of a root this process
computed (the root is a one-way hash; the export names its tenants).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.kv.pages import PagePool

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
    last_used: int
    root: bytes
    tokens: tuple[int, ...]
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

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._entries: dict[bytes, _Entry] = {}
        self._clock = 0
        self.queries = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

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
        for entry in pages:
            entry.last_used = self._clock
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
        t = self.pool.page_tokens
        for i, h in enumerate(page_hashes(root, token_ids, t)):
            entry = self._entries.get(h)
            if entry is None:
                self.pool.share([page_table[i]])
                entry = self._entries[h] = _Entry(page_table[i], parent, self._clock, root,
                                                  tuple(token_ids[i * t:(i + 1) * t]))
                if parent is not None:
                    self._entries[parent].children += 1
                added += 1
            entry.last_used = self._clock
            parent = h
        return added

    def evict(self, pages_wanted: int) -> int:
        """Free up to `pages_wanted` pages held only by the cache, oldest leaves first."""
        freed = 0
        while freed < pages_wanted:
            leaves = [(e.last_used, h) for h, e in self._entries.items()
                      if e.children == 0 and self.pool.refcount(e.page) == 1]
            if not leaves:
                break
            _, h = min(leaves)
            entry = self._entries.pop(h)
            if entry.parent is not None:
                self._entries[entry.parent].children -= 1
            self.pool.free([entry.page])
            freed += 1
        return freed

    def clear(self) -> None:
        """Drop every cache reference (engine shutdown or format change)."""
        for entry in self._entries.values():
            self.pool.free([entry.page])
        self._entries.clear()
