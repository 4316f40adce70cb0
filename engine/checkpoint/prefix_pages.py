"""Prefix-cache handoff: export every cached full page of one engine, import them into another.

A draining replica's conversations live, between turns, as prefix-cache pages (prompt + reply,
engine/kv/prefix.py). `export_pages` writes them as one KV checkpoint (engine/checkpoint/
format.py: rows byte for byte, manifest with data hash and, with a key, HMAC) whose manifest also
names, under `prefix_pages`, the engine's format and storage identity, each tenant with its chain
root, and each page's tenant, parent and token ids. `import_pages` refuses, before allocating
anything, an export of another format identity, storage layout, model or page size, a tenant
whose root this engine would compute differently, and any page whose chain hash, recomputed here
from this engine's root and the page's token ids, is not the one the export names. Imported pages
join the cache under their own tenant's root only, so another tenant's lookups can never reach
them; the next turn of a moved conversation, resent with its history, hits them like pages this
engine wrote.

Runs on the engine thread, between steps (`Engine.call`: the rows read were written by retired
steps, and MLX is thread-local); `export_from` / `import_into` are the calls. A drain exports once
the replica's last request has finished (Serve stops routing to it and waits for its requests
before calling its destructor), so the replies of its conversations are in the cache. Pages already cached here are not imported twice; pages beyond the free pool or
byte budget (or all of them while the engine runs at its concurrency ceiling) are left out, a
child never without its parent, and reported as skipped.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.checkpoint.format import (CheckpointError, check_compatible, load_rows,
                                      read_manifest, save_checkpoint, write_rows)
from engine.kv.prefix import chain_root, root_tenant

CODEC = "orchard-prefix-pages-v1"
_IMPORT_ID = "prefix-import"   # the ledger reservation an import's pages are charged through


def export_from(engine: Any, directory: str | Path, timeout_s: float = 60.0) -> dict:
    """`export_pages` of a running Engine, on its thread between steps."""
    return engine.call(lambda parts: export_pages(parts, directory), timeout_s)


def import_into(engine: Any, directory: str | Path, timeout_s: float = 60.0) -> dict:
    """`import_pages` into a running Engine, on its thread between steps."""
    return engine.call(lambda parts: import_pages(parts, directory), timeout_s)


def export_pages(parts: Any, directory: str | Path) -> dict:
    """Write every page the engine's prefix cache holds to `directory`; a summary
    ({"pages", "tokens", "tenants", "format_identity"}). Nothing is written when the cache is
    empty (pages 0)."""
    cache = _cache(parts)
    entries = cache.entries()
    summary = {"pages": len(entries), "tokens": len(entries) * cache.pool.page_tokens,
               "tenants": {}, "format_identity": parts.format_identity}
    if not entries:
        return summary
    roots: dict[bytes, int] = {}
    index = {e.key: i for i, e in enumerate(entries)}
    tenants, pages, token_ids = [], [], []
    for e in entries:
        if e.root not in roots:
            tenant = root_tenant(e.root)
            if tenant is None:   # every root is computed by chain_root in this process
                raise CheckpointError("a cached chain's tenant is unknown to this process")
            roots[e.root] = len(tenants)
            tenants.append({"tenant": tenant, "root": e.root.hex()})
        pages.append([roots[e.root], -1 if e.parent is None else index[e.parent], e.key.hex()])
        token_ids.extend(int(t) for t in e.tokens)
    meta = {"codec": CODEC, "format_identity": parts.format_identity,
            "storage_identity": parts.storage_identity, "tenants": tenants, "pages": pages,
            "token_ids": token_ids}
    save_checkpoint(directory, parts.kvstore, [e.page for e in entries], token_ids,
                    model_fingerprint=parts.loaded.fingerprint, key=parts.checkpoints.key,
                    extra={"prefix_pages": meta})
    for t in tenants:
        summary["tenants"][t["tenant"]] = sum(1 for p in pages if tenants[p[0]] is t)
    return summary


def import_pages(parts: Any, directory: str | Path) -> dict:
    """Import an export into this engine's prefix cache; a summary ({"pages" imported,
    "already_cached", "skipped" for room, "tenants": {tenant: pages imported}}). Raises
    CheckpointError, with nothing allocated, for an export this engine must not use."""
    cache = _cache(parts)
    pt = cache.pool.page_tokens
    manifest = read_manifest(directory, parts.checkpoints.key)
    meta = _meta(manifest)
    if meta["format_identity"] != parts.format_identity:
        raise CheckpointError(f"prefix pages of format identity {meta['format_identity']!r} "
                              f"cannot be imported into an engine of {parts.format_identity!r}")
    if meta["storage_identity"] != parts.storage_identity:
        raise CheckpointError(f"prefix pages stored as {meta['storage_identity']!r} cannot be "
                              f"imported into an engine storing {parts.storage_identity!r}")
    fingerprint = parts.loaded.fingerprint
    token_ids = meta["token_ids"]
    check_compatible(manifest, parts.kvstore, fingerprint, token_ids)
    entries = _verified_chains(meta, parts.storage_identity, fingerprint, pt)
    # Entries are in chain order, so a prefix of the pages not cached here keeps every parent.
    new = [i for i, e in enumerate(entries) if e[2] not in cache]
    tensors = load_rows(directory, manifest, parts.kvstore) if new else {}   # the last check
    ledger = parts.scheduler.ledger
    take = new[:_charge_cache(ledger, min(len(new), cache.pool.num_free), pt)]
    summary = {"pages": 0, "already_cached": len(entries) - len(new),
               "skipped": len(new) - len(take), "tenants": {}}
    if not take:
        return summary
    rows = mx.array([i * pt + r for i in take for r in range(pt)], dtype=mx.int32)
    new_pages = cache.pool.allocate(len(take))
    try:
        write_rows(parts.kvstore, {name: a[_sink_rows(a, take, len(entries))
                                            if name.endswith("sink") else rows]
                                   for name, a in tensors.items()}, new_pages, len(take) * pt)
    except Exception:
        cache.pool.free(new_pages)
        ledger.uncharge_cache(len(take))
        raise
    page_of = dict(zip(take, new_pages))
    kept = set(page_of) | {i for i, e in enumerate(entries) if e[2] in cache}
    added = 0
    for leaf in (i for i in _leaves(entries, kept) if i in page_of):
        chain = _chain(entries, leaf)
        ids = [t for j in chain for t in token_ids[j * pt:(j + 1) * pt]]
        # insert shares only the pages it newly caches: those of this import
        added += cache.insert(entries[leaf][0], ids, [page_of.get(j, -1) for j in chain])
    cache.pool.free(new_pages)   # the cache holds them now
    if added < len(take):   # only a (signed) export naming a page twice; never leak a charge
        ledger.uncharge_cache(len(take) - added)
    for i in take:
        tenant = meta["tenants"][entries[i][3]]["tenant"]
        summary["tenants"][tenant] = summary["tenants"].get(tenant, 0) + 1
    summary["pages"] = added
    return summary


def _cache(parts: Any):
    cache = parts.scheduler.prefix
    if cache is None:
        raise CheckpointError("prefix caching is off in this engine: no pages to hand off")
    return cache


def _meta(manifest: dict) -> dict:
    meta = manifest.get("prefix_pages")
    if not isinstance(meta, dict) or meta.get("codec") != CODEC:
        raise CheckpointError("not a prefix-page export (no prefix_pages section of codec "
                              f"{CODEC!r})")
    for name, kind in (("format_identity", str), ("storage_identity", str), ("tenants", list),
                       ("pages", list), ("token_ids", list)):
        if not isinstance(meta.get(name), kind):
            raise CheckpointError(f"prefix-page export field {name!r} missing or malformed")
    return meta


def _verified_chains(meta: dict, storage: str, fingerprint: str, pt: int) -> list[tuple]:
    """(root, parent index, chain hash, tenant index) per page, every hash recomputed here."""
    roots = []
    for t in meta["tenants"]:
        if not isinstance(t, dict) or not isinstance(t.get("tenant"), str) or not t["tenant"]:
            raise CheckpointError("prefix-page export names a tenant badly")
        root = chain_root(storage, fingerprint, t["tenant"], pt)
        if t.get("root") != root.hex():
            raise CheckpointError(f"tenant {t['tenant']!r}: the export's chain root is not this "
                                  "engine's (another format identity, model or page size)")
        roots.append(root)
    ids = meta["token_ids"]
    if len(ids) != len(meta["pages"]) * pt:
        raise CheckpointError("prefix-page export: token ids do not fill its pages")
    out: list[tuple] = []
    for i, page in enumerate(meta["pages"]):
        if not (isinstance(page, list) and len(page) == 3 and isinstance(page[0], int)
                and 0 <= page[0] < len(roots) and isinstance(page[1], int)
                and -1 <= page[1] < i and isinstance(page[2], str)):
            raise CheckpointError(f"prefix-page export: page {i} is malformed")
        tenant, parent, key = page
        if parent != -1 and out[parent][3] != tenant:
            raise CheckpointError(f"prefix-page export: page {i} continues another tenant's chain")
        prev = roots[tenant] if parent == -1 else out[parent][2]
        h = hashlib.sha256(prev + b"".join(int(t).to_bytes(8, "little", signed=True)
                                           for t in ids[i * pt:(i + 1) * pt])).digest()
        if h.hex() != key:
            raise CheckpointError(f"prefix-page export: page {i}'s chain hash does not match "
                                  "its tokens")
        out.append((roots[tenant], parent, h, tenant))
    return out


def _sink_rows(a, take: list[int], pages: int):
    per = a.shape[0] // pages   # full pages: the same number of sink rows in each
    return mx.array([i * per + r for i in take for r in range(per)], dtype=mx.int32)


def _leaves(entries: list[tuple], kept: set[int]) -> list[int]:
    parents = {entries[i][1] for i in kept}
    return [i for i in sorted(kept) if i not in parents]


def _chain(entries: list[tuple], i: int) -> list[int]:
    chain = []
    while i != -1:
        chain.append(i)
        i = entries[i][1]
    return chain[::-1]


def _charge_cache(ledger, pages: int, page_tokens: int) -> int:
    """Charge up to `pages` imported pages to the prefix cache; how many were charged. The
    ledger takes cache pages only from a refunding request, so the import reserves them as one
    (within its per-request token limit, a chunk at a time) and leaves them all to the cache."""
    step, done = max(1, ledger.cost_model.token_limit // page_tokens), 0
    while done < pages:
        n = min(step, pages - done)
        while n and not ledger.fits(n * page_tokens):
            n //= 2
        if not n:
            break
        ledger.reserve(_IMPORT_ID, n * page_tokens)
        ledger.refund(_IMPORT_ID, to_cache_pages=n)
        done += n
    return done
