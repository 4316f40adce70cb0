"""Prefix affinity: which replica already holds the longest cached prefix of a request.

A replica reports what its prefix cache holds in its routing stats (`PrefixReport`): the inputs
of the engine's chain root except the tenant, and the first KEY_BYTES bytes of every cached
page's chain hash, with a sequence number. The router hashes a request's prompt the same way
(engine.kv.prefix, pure Python, no MLX) under the request's own tenant, so a match can only be
found among that tenant's pages: routing never sends a tenant toward another tenant's pages, and
the engine's own lookup (full hashes, same roots) is what actually shares pages.

Reports arrive every routing-stats period, so a request routed just now is not in them yet: the
router also remembers the pages it sent to each replica (`PrefixIndex.routed`) until a report that
was certainly produced afterwards arrives (two sequence numbers later), and that report is
then authoritative (it reflects the replica's evictions too).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable

from engine.kv.prefix import chain_root, page_hashes

# 8 bytes per page: a 64-bit key collides by chance with odds ~n^2/2^65 for n cached pages, and
# a collision only mis-steers routing (the engine matches full hashes).
KEY_BYTES = 8


class PrefixReport:
    """The `prefix` entry of one replica's routing stats (None while prefix caching is off)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._seq = itertools.count(1)

    def __call__(self) -> dict | None:
        if not self.engine.cfg.enable_prefix_caching:
            return None
        keys = b"".join(h[:KEY_BYTES] for h in self.engine.prefix_page_hashes())
        return {"seq": next(self._seq), "storage_identity": self.engine.storage_identity,
                "fingerprint": self.engine.loaded.fingerprint,
                "page_tokens": int(self.engine.cfg.page_tokens),
                "tenant": self.engine.cfg.tenant, "keys": keys}


@dataclass
class _Replica:
    seq: int
    root_facts: tuple[str, str, int, str]   # storage identity, fingerprint, page tokens, tenant
    reported: frozenset[bytes]
    routed: dict[bytes, int]                # key -> last report seq seen when it was routed


def _split(blob: bytes) -> frozenset[bytes]:
    return frozenset(blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES))


class PrefixIndex:
    """The router's view of every replica's cached prefixes (one per router, event-loop only)."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}

    def observe(self, replica_id: str, report: dict | None) -> None:
        """Take a replica's latest routing-stats `prefix` entry (cheap when unchanged)."""
        if not isinstance(report, dict):
            self._replicas.pop(replica_id, None)
            return
        seq = int(report.get("seq", 0))
        old = self._replicas.get(replica_id)
        if old is not None and old.seq == seq:
            return
        facts = (str(report["storage_identity"]), str(report["fingerprint"]),
                 int(report["page_tokens"]), str(report["tenant"]))
        routed = {} if old is None or old.root_facts != facts else {
            k: s for k, s in old.routed.items() if seq < s + 2}
        self._replicas[replica_id] = _Replica(seq, facts, _split(report.get("keys", b"")),
                                              routed)

    def forget(self, replica_ids: Iterable[str]) -> None:
        for rid in replica_ids:
            self._replicas.pop(rid, None)

    def request_keys(self, replica_id: str, tenant: str | None,
                     prompt_ids: list[int]) -> list[bytes]:
        """The keys of the prompt's full pages as this replica's engine would look them up
        (the last prompt token is always computed, so it is left out as the engine does)."""
        rep = self._replicas.get(replica_id)
        if rep is None:
            return []
        storage, fingerprint, page_tokens, default_tenant = rep.root_facts
        root = chain_root(storage, fingerprint, tenant or default_tenant, page_tokens)
        return [h[:KEY_BYTES] for h in page_hashes(root, prompt_ids[:-1], page_tokens)]

    def matches(self, replica_ids: Iterable[str], tenant: str | None,
                prompt_ids: list[int]) -> dict[str, int]:
        """replica id -> tokens of the prompt's longest prefix it holds (0 when none)."""
        out, keys_by_root = {}, {}
        for rid in replica_ids:
            rep = self._replicas.get(rid)
            if rep is None:
                out[rid] = 0
                continue
            keys = keys_by_root.get(rep.root_facts)
            if keys is None:
                keys = keys_by_root[rep.root_facts] = self.request_keys(rid, tenant, prompt_ids)
            pages = 0
            for k in keys:
                if k not in rep.reported and k not in rep.routed:
                    break
                pages += 1
            out[rid] = pages * rep.root_facts[2]
        return out

    def routed(self, replica_id: str, keys: list[bytes]) -> None:
        """A request with these page keys was sent to the replica: its pages will be cached
        there (pages are published as prefill retires) before the next report says so."""
        rep = self._replicas.get(replica_id)
        if rep is not None:
            for k in keys:
                rep.routed[k] = rep.seq
