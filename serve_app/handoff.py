"""Conversation handoff on drain (issue 35 item 2): a replica that shuts down gracefully hands
the pages of its prefix cache to another replica of the same model, so a moved conversation's
next turn, resent with its history, hits cached pages there instead of a full prefill.

Between turns a conversation lives as prefix-cache pages (prompt + reply) of the replica that
served it. On drain (Serve calls the replica's destructor after it stopped routing to it and its
requests finished: a redeploy, a scale-down), `Handoff.drain` exports them (engine/checkpoint/
prefix_pages.py: rows byte for byte, the engine's format identity, tenants and chain hashes,
signed with the checkpoint key when one is configured) and leaves the files with the `handoff`
store, a detached named actor in the capacity namespace, so any node can read them. Every
replica polls the store (`Handoff.watch`) and claims exports of its model and format identity
that another replica left; the claimant imports them into its own cache (refused across format
identities, each page only under its own tenant's root), and its routing stats' prefix report
then shows the pages, so the router's prefix affinity sends the conversation there.

An abrupt death (a killed process, a lost node) leaves nothing: its conversations' next turns
are recomputed wherever they land. An export nobody claims is dropped after STORE_TTL_S, and
the store keeps at most STORE_MAX_BYTES (oldest dropped first).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("orchard.handoff")

STORE_NAME = "handoff"
POLL_S = 0.5                 # how often a replica looks for exports to import
PUT_TIMEOUT_S = 30.0         # a drain waits this long for the store to take its export
STORE_TTL_S = 600.0
STORE_MAX_BYTES = 4 << 30


class HandoffStore:
    """Exports waiting for a replica (run as a Ray actor; plain Python, testable without Ray)."""

    def __init__(self, max_bytes: int = STORE_MAX_BYTES, ttl_s: float = STORE_TTL_S):
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._waiting: list[dict] = []
        self._events: list[dict] = []
        self._ids = itertools.count(1)

    def put(self, model_id: str, format_identity: str, replica_id: str,
            files: dict[str, bytes], summary: dict) -> int:
        export = {"id": next(self._ids), "model_id": model_id,
                  "format_identity": format_identity, "from": replica_id, "files": files,
                  "summary": summary, "bytes": sum(len(b) for b in files.values()),
                  "at": time.monotonic()}
        self._waiting.append(export)
        self._event("exported", export)
        self._expire()
        return export["id"]

    def claim(self, model_id: str, format_identity: str, replica_id: str) -> dict | None:
        """The oldest export of this model and identity left by another replica (removed)."""
        self._expire()
        for export in self._waiting:
            if (export["model_id"], export["format_identity"]) == (model_id, format_identity) \
                    and export["from"] != replica_id:
                self._waiting.remove(export)
                self._event("claimed", export, by=replica_id)
                return export
        return None

    def report(self, export_id: int, replica_id: str, result: dict) -> None:
        self._events.append({"event": "imported", "id": export_id, "by": replica_id,
                             "result": result})

    def events(self) -> list[dict]:
        """What happened to every export (oldest first): exported, claimed, imported, dropped."""
        return list(self._events)

    def _event(self, name: str, export: dict, **more) -> None:
        self._events.append({"event": name, "id": export["id"], "model_id": export["model_id"],
                             "from": export["from"], "bytes": export["bytes"],
                             "summary": export["summary"], **more})

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting and (now - self._waiting[0]["at"] > self.ttl_s
                                 or sum(e["bytes"] for e in self._waiting) > self.max_bytes):
            self._event("dropped", self._waiting.pop(0))


def store_actor(namespace: str) -> Any:
    """The store, created by the first replica that needs it; detached, so it outlives the
    replica that created it (that one may be the one draining)."""
    import ray

    return ray.remote(num_cpus=0)(HandoffStore).options(
        name=STORE_NAME, namespace=namespace, lifetime="detached", get_if_exists=True).remote()


class Handoff:
    """One replica's side: drain (export and leave), watch (claim and import)."""

    def __init__(self, engine: Any, model_id: str, replica_id: str, namespace: str):
        self.engine, self.model_id, self.replica_id = engine, model_id, replica_id
        self.namespace = namespace
        self._store: Any = None
        self._task: asyncio.Task | None = None
        self._drained = False
        self._claimed: dict | None = None   # an export claimed and not yet reported imported

    @classmethod
    def for_replica(cls, engine: Any, model_id: str, replica_id: str,
                    capacity: Any) -> "Handoff | None":
        """A handoff for a Serve replica with prefix caching whose capacity settings
        (serve_app/config.py CapacitySettings) have `handoff` on; None elsewhere (turned off,
        nothing to hand off, or no Ray to hand it through)."""
        if capacity is None or not capacity.handoff or not engine.cfg.enable_prefix_caching:
            return None
        namespace = capacity.namespace
        try:
            import ray
        except ImportError:
            return None
        return cls(engine, model_id, replica_id, namespace) if ray.is_initialized() else None

    def store(self) -> Any:
        if self._store is None:
            self._store = store_actor(self.namespace)
        return self._store

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.watch())

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.take_one()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed import costs a recompute, never the replica
                log.exception("importing handed-off prefix pages failed")

    async def take_one(self) -> dict | None:
        """Claim and import one export waiting for this replica; the import's summary."""
        if not self.engine.healthy():
            return None
        store = await asyncio.to_thread(self.store)
        export = await store.claim.remote(self.model_id, self.engine.format_identity,
                                          self.replica_id)
        if export is None:
            return None
        self._claimed = export
        result = await asyncio.to_thread(self._import, export)
        self._claimed = None
        return result

    def _import(self, export: dict) -> dict:
        """Import a claimed export (blocking) and tell the store how it went."""
        from engine.checkpoint.prefix_pages import import_into

        with tempfile.TemporaryDirectory(prefix="orchard-handoff-") as d:
            for name, data in export["files"].items():
                (Path(d) / Path(name).name).write_bytes(data)
            try:
                result = import_into(self.engine, d)
            except Exception as e:  # noqa: BLE001 - refused (another identity, key): reported
                result = {"error": f"{type(e).__name__}: {e}"}
        log.info("imported prefix pages of %s from %s: %s", self.model_id, export["from"], result)
        self.store().report.remote(export["id"], self.replica_id, result)
        return result

    def drain(self) -> dict:
        """Export this replica's prefix cache and leave it with the store (on shutdown, after
        the last request finished; blocking). Never raises: a failed handoff is a recompute."""
        if self._task is not None:   # a draining replica takes nothing more
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
        if self._drained or not self.engine.healthy():
            return {"pages": 0}
        self._drained = True
        try:
            from engine.checkpoint.prefix_pages import export_from

            if self._claimed is not None:
                # Claimed just before the drain: import it (again: engine calls run in order,
                # so a second import of pages already taken adds nothing) to pass it on.
                self._import(self._claimed)

            with tempfile.TemporaryDirectory(prefix="orchard-handoff-") as d:
                summary = export_from(self.engine, d)
                if summary["pages"]:
                    import ray

                    files = {p.name: p.read_bytes() for p in Path(d).iterdir() if p.is_file()}
                    ray.get(self.store().put.remote(self.model_id, self.engine.format_identity,
                                                    self.replica_id, files, summary),
                            timeout=PUT_TIMEOUT_S)
            log.info("handed off prefix pages of %s from %s: %s", self.model_id,
                     self.replica_id, summary)
            return summary
        except Exception as e:  # noqa: BLE001 - the drain itself must go on
            log.exception("handing off prefix pages failed")
            return {"error": repr(e)}
