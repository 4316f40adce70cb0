"""The capacity actor (the only Ray code in capacity/).

Clients reach it through CapacityClient (serve_app/capacity_client.py). The actor is named,
detached, async, `num_cpus=0` (it never blocks scheduling) and restartable
(`max_restarts=-1`; `max_task_retries=-1` makes calls at-least-once, which is why every method is
idempotent by request id or heartbeat sequence). It persists rate histories to a JSON snapshot file
periodically and restores them in __init__ after a restart; reservations are not persisted, they
come back from the replicas' next heartbeats (each lists its active requests). Each method runs
Fleet code to completion without awaiting, so no lock is ever held across the fleet.

Hot path: the actor also serves its batches over a direct TCP connection
(capacity/transport/fastpath.py), because a Ray call costs milliseconds on a busy box;
`endpoint()` tells clients where, with a token that changes with every incarnation. Holds may wait for capacity in a per-model FIFO
(capacity/waiting.py) instead of being refused at once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time

import ray

from capacity.fleet import Fleet, FleetConfig
from capacity.operations import CancelOp, CommitOp, HeartbeatOp, HoldOp, ReleaseOp
from capacity.ops import BatchOps
from capacity.protocol import ActorInfo
from capacity.snapshot_file import default_snapshot_path, read_snapshot, write_snapshot
from capacity.transport.fastpath import FastServer

log = logging.getLogger("orchard.capacity")

DEFAULT_NAME = "capacity"
DEFAULT_NAMESPACE = "orchard"
PERSIST_INTERVAL_S = 10.0    # how much learning a crash may lose
REAP_INTERVAL_S = 1.0        # TTL reaper period (hold TTL is 30 s by default, so 1 s is plenty)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class CapacityActor:
    def __init__(self, config: dict | None = None, snapshot_path: str | None = None,
                 persist_interval_s: float = PERSIST_INTERVAL_S,
                 reap_interval_s: float = REAP_INTERVAL_S):
        self.cfg = FleetConfig.from_dict(config)
        self.path = default_snapshot_path() if snapshot_path is None else snapshot_path
        state = read_snapshot(self.path)
        self.fleet = Fleet.restore(state, self.cfg)
        self.restored = state is not None
        self.reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        self.persist_interval_s = persist_interval_s
        self.reap_interval_s = reap_interval_s
        self.persisted_at: float | None = None
        self.service = BatchOps(self.fleet)      # the batch path of both transports
        self.waits = self.service.waits
        self.token = secrets.token_urlsafe(24)    # per incarnation: a restart invalidates it
        self._fast: FastServer | None = None
        self._fast_lock = asyncio.Lock()
        self._bg: asyncio.Task | None = None

    def _ensure_background(self) -> None:
        # Started lazily: the event loop is not running yet inside __init__.
        if self._bg is None or self._bg.done():
            self._bg = asyncio.get_running_loop().create_task(self._background())

    async def _background(self) -> None:
        last_persist = time.monotonic()
        while True:
            await asyncio.sleep(self.reap_interval_s)
            self.service.expire()
            if self.path and time.monotonic() - last_persist >= self.persist_interval_s:
                last_persist = time.monotonic()
                try:
                    await self._persist()
                except OSError:
                    log.warning("capacity snapshot to %s failed", self.path, exc_info=True)

    async def _persist(self) -> str:
        state = self.fleet.persist_state()       # built on the loop: consistent, no lock needed
        await asyncio.to_thread(write_snapshot, self.path, state)
        self.persisted_at = time.time()
        return self.path

    # ---- API (every method idempotent) -------------------------------------------------------

    async def info(self) -> dict:
        self._ensure_background()
        return {**ActorInfo().model_dump(), "restored": self.restored,
                "reconstructed": self.reconstructed, "snapshot_path": self.path,
                "persisted_at": self.persisted_at, "identities": len(self.fleet.rates),
                "batches": self.service.batches, "ops": self.service.ops,
                "waiting": len(self.waits), "waits": self.waits.stats.as_dict(),
                "fast": dict(self._fast.stats) if self._fast else None,
                "pid": os.getpid()}

    async def endpoint(self) -> dict | None:
        """Where the direct transport listens: {host, port, token, pid}; None if it could not
        start (clients then stay on Ray calls)."""
        self._ensure_background()
        async with self._fast_lock:
            if self._fast is None:
                server = FastServer(self.token, self._apply_ops, self.waits.drop_owner)
                try:
                    await server.start(ray.util.get_node_ip_address())
                except OSError:
                    log.warning("capacity fast path could not listen; Ray calls only", exc_info=True)
                    return None
                self._fast = server
        return {"host": self._fast.host, "port": self._fast.port, "token": self.token,
                "pid": os.getpid()}

    async def hold(self, model_id: str, raw_tokens: int, request_id: str,
                   prompt_tokens: int | None = None, exclude=(), wait_s: float = 0.0,
                   affine: bool = False, saved_tokens: int = 0) -> dict:
        return (await self.apply([HoldOp(model_id, raw_tokens, request_id, prompt_tokens,
                                         exclude, wait_s, affine, saved_tokens)]))[0]

    async def apply(self, ops: list) -> list:
        """A batch applied in order: operations or their wire forms (capacity/operations.py).
        A hold that waits delays only this call's reply, not its batch-mates' effects."""
        out = self._apply_ops(ops, None)
        if any(isinstance(r, asyncio.Future) for r in out):
            out = [await asyncio.shield(r) if isinstance(r, asyncio.Future) else r for r in out]
        return out

    def _apply_ops(self, ops: list, owner: object | None) -> list:
        """Both transports' batch path (capacity/ops.py); a waiting hold's entry is a future."""
        self._ensure_background()
        return self.service.apply(ops, owner)

    async def heartbeat(self, report: dict) -> dict:
        return (await self.apply([HeartbeatOp(report)]))[0]

    async def commit(self, request_id: str, replica_id: str, raw_tokens: int | None = None,
                     model_id: str | None = None) -> bool:
        return (await self.apply([CommitOp(request_id, replica_id, raw_tokens, model_id)]))[0]

    async def release(self, request_id: str, telemetry: dict | None = None) -> bool:
        """`telemetry`: RequestTelemetry's wire form (ReleaseOp validates it)."""
        return (await self.apply([ReleaseOp(request_id, telemetry)]))[0]

    async def cancel(self, request_id: str) -> bool:
        return (await self.apply([CancelOp(request_id)]))[0]

    async def snapshot(self) -> dict:
        self._ensure_background()
        return self.fleet.snapshot(time.monotonic())

    async def caps(self) -> dict:
        return self.fleet.caps()

    async def anomalies(self) -> list:
        return [a.__dict__ for a in self.fleet.anomalies()]

    async def knows_step_profile(self, model_id: str, chip_class: str | None,
                                 execution: str | None) -> bool:
        """Whether this identity's decode steps are measured at two batch sizes or more on this
        chip class: a replacement replica then skips re-measuring them (engine/warmup.py).
        `execution` in wire form, as heartbeats carry it (None = native)."""
        from capacity.errors import IdentityError
        from capacity.identity import ExecutionKey, normalize_chip_class, parse_execution

        try:
            key = ExecutionKey(model_id, normalize_chip_class(chip_class),
                               parse_execution(execution))
        except IdentityError:
            return False
        return not key.is_invalid and self.fleet.rates.step_fit(key) is not None

    async def persist_now(self) -> str | None:
        return await self._persist() if self.path else None


def get_or_create_actor(namespace: str = DEFAULT_NAMESPACE, name: str = DEFAULT_NAME,
                        config: dict | None = None, snapshot_path: str | None = None,
                        persist_interval_s: float = PERSIST_INTERVAL_S,
                        reap_interval_s: float = REAP_INTERVAL_S,
                        resources: dict[str, float] | None = None):
    """Create-or-get the named detached actor (idempotent across callers). Blocking GCS call.

    `resources` pins where it is created (e.g. {"head": 0.01}): unpinned, Ray may place it on
    a worker, and losing that worker would then take the ledger down with the worker's slots.
    A bad `config` raises ConfigInvalid here, naming the key, not inside the actor's start."""
    FleetConfig.from_dict(config)
    return CapacityActor.options(name=name, namespace=namespace, lifetime="detached",
                                 get_if_exists=True, resources=resources or None).remote(
        config, snapshot_path, persist_interval_s, reap_interval_s)
