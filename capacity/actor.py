"""The capacity actor (the only Ray code in capacity/) and the client replicas and routers use.

The actor is named, detached, async, `num_cpus=0` (it never blocks scheduling) and restartable
(`max_restarts=-1`; `max_task_retries=-1` makes calls at-least-once, which is why every method is
idempotent by request id or heartbeat sequence). It persists rate histories to a JSON snapshot file
periodically and restores them in __init__ after a restart; reservations are not persisted, they
come back from the replicas' next heartbeats (each lists its active requests). Each method runs
Fleet code to completion without awaiting, so no lock is ever held across the fleet.

Hot path: the actor also serves its batches over a direct TCP connection (capacity/fastpath.py),
because a Ray call costs milliseconds on a busy box; `endpoint()` tells clients where, with a
token that changes with every incarnation. Holds may wait for capacity in a per-model FIFO
(capacity/waiting.py) instead of being refused at once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from capacity.errors import CapacityError, CapacityRefused
from capacity.fast_link import FastLink
from capacity.fastpath import FastConnection, FastFailed, FastServer, FastUnsendable
from capacity.fleet import Fleet, FleetConfig, Hold
from capacity.local_admissions import LocalAdmissions
from capacity.ops import BatchOps
from capacity.protocol import ActorInfo, HeartbeatReport, RequestTelemetry
from capacity.report_batcher import ReportBatcher
from capacity.snapshot_file import default_snapshot_path, read_snapshot, write_snapshot

log = logging.getLogger("orchard.capacity")

DEFAULT_NAME = "capacity"
DEFAULT_NAMESPACE = "orchard"
PERSIST_INTERVAL_S = 10.0    # how much learning a crash may lose
REAP_INTERVAL_S = 1.0        # TTL reaper period (hold TTL is 30 s by default, so 1 s is plenty)


class CapacityUnavailable(CapacityError):
    """The actor could not be reached (dead, restarting past the timeout, or never created)."""


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
                   prompt_tokens: int | None = None, exclude=(), wait_s: float = 0.0) -> dict:
        return (await self.apply([("hold", model_id, raw_tokens, request_id, prompt_tokens,
                                   exclude, wait_s)]))[0]

    async def apply(self, ops: list[tuple]) -> list:
        """A batch applied in order: (op, args...), op in hold/commit/release/cancel/heartbeat.
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
        return (await self.apply([("heartbeat", report)]))[0]

    async def commit(self, request_id: str, replica_id: str, raw_tokens: int | None = None,
                     model_id: str | None = None) -> bool:
        return (await self.apply([("commit", request_id, replica_id, raw_tokens, model_id)]))[0]

    async def release(self, request_id: str, telemetry: dict | None = None) -> bool:
        return (await self.apply([("release", request_id, telemetry)]))[0]

    async def cancel(self, request_id: str) -> bool:
        return (await self.apply([("cancel", request_id)]))[0]

    async def snapshot(self) -> dict:
        self._ensure_background()
        return self.fleet.snapshot(time.monotonic())

    async def caps(self) -> dict:
        return self.fleet.caps()

    async def anomalies(self) -> list:
        return [a.__dict__ for a in self.fleet.anomalies()]

    async def persist_now(self) -> str | None:
        return await self._persist() if self.path else None


def get_or_create_actor(namespace: str = DEFAULT_NAMESPACE, name: str = DEFAULT_NAME,
                        config: dict | None = None, snapshot_path: str | None = None,
                        persist_interval_s: float = PERSIST_INTERVAL_S,
                        reap_interval_s: float = REAP_INTERVAL_S,
                        resources: dict[str, float] | None = None):
    """Create-or-get the named detached actor (idempotent across callers). Blocking GCS call.

    `resources` pins where it is created (e.g. {"head": 0.01}): unpinned, Ray may place it on
    a worker, and losing that worker would then take the ledger down with the worker's slots."""
    return CapacityActor.options(name=name, namespace=namespace, lifetime="detached",
                                 get_if_exists=True, resources=resources or None).remote(
        config, snapshot_path, persist_interval_s, reap_interval_s)


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def _checked(op: tuple, result: Any) -> Any:
    """An op the actor rejected as malformed comes back as {"error": ...}: raise it here."""
    if isinstance(result, dict) and "error" in result:
        raise CapacityError(f"{op[0]} rejected: {result['error']}: {result.get('detail', '')}")
    return result


class CapacityClient:
    """Caches the actor handle and the last caps, batches reports, and falls back to a conservative
    local cap when the actor is unreachable (so an actor outage degrades admission, not serving).

    Calls (hold/commit/release/cancel/heartbeat) are batched without a timer
    (capacity/report_batcher.py); each batch is applied in order.

    Transport (`transport="auto"`, the default): after its first Ray call the client asks the actor
    for its direct endpoint in the background and from then on sends batches over one persistent
    connection per event loop (capacity/fastpath.py). Any failure there (connection lost, timeout,
    refused token) sends that batch through Ray instead and rediscovers the endpoint after a
    backoff (the actor may have restarted on a new port with a new token). `transport="ray"`
    never uses the direct connection. Heartbeats, commits and releases ride the same batches;
    snapshot/info stay Ray calls.
    """

    def __init__(self, namespace: str = DEFAULT_NAMESPACE, name: str = DEFAULT_NAME, *,
                 create: bool = True, config: dict | None = None, snapshot_path: str | None = None,
                 call_timeout_s: float = 2.0, fallback_cap: int = 1, backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0, max_batch: int = 512, max_inflight: int = 2,
                 first_call_timeout_s: float = 30.0, transport: str = "auto",
                 fast_retry_s: float = 0.5, resources: dict[str, float] | None = None):
        if transport not in ("auto", "ray"):
            raise ValueError(f"transport must be 'auto' or 'ray', got {transport!r}")
        self.namespace, self.name, self.create = namespace, name, create
        self.config, self.snapshot_path = config, snapshot_path
        self.resources = resources                # where to create the actor if it is gone
        self.call_timeout_s = call_timeout_s      # a hold slower than this counts as unreachable
        # The client's first call may have to wait for the actor process to start (seconds on a
        # busy 2-core box); only that call gets the longer timeout.
        self.first_call_timeout_s = max(first_call_timeout_s, call_timeout_s)
        self._answered = False
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.caps: dict[str, int] = {}            # model -> last cap the actor returned
        self.faults = 0
        self._handle = None
        self._down_until = 0.0
        # In-flight requests per model (fallback_cap) while the actor is unreachable.
        self._local = LocalAdmissions(fallback_cap, backoff_s)
        self._batcher = ReportBatcher(self._send, max_batch=max_batch, max_inflight=max_inflight,
                                      failure=CapacityUnavailable)
        self.transport = transport
        self.ray_batches = 0                      # batches sent as Ray calls
        self.fast_link = FastLink(self._discover_endpoint, timeout_s=call_timeout_s,
                                  retry_s=fast_retry_s, max_backoff_s=max_backoff_s,
                                  spawn=self._spawn)
        self._tasks: set[asyncio.Task] = set()

    # ---- transport ------------------------------------------------------------------------

    async def _get_handle(self):
        if self._handle is None:
            if self.create:
                self._handle = await asyncio.to_thread(
                    get_or_create_actor, self.namespace, self.name, self.config, self.snapshot_path,
                    resources=self.resources)
            else:
                self._handle = await asyncio.to_thread(ray.get_actor, self.name, self.namespace)
        return self._handle

    def _fault(self) -> None:
        self.faults += 1
        self._handle = None   # the next call looks the actor up again (it may have been recreated)
        self._down_until = time.monotonic() + min(self.max_backoff_s,
                                                  self.backoff_s * 2 ** min(self.faults - 1, 16))

    async def _call(self, method: str, *args, timeout: float | None = None) -> Any:
        if time.monotonic() < self._down_until:
            raise CapacityUnavailable("capacity actor marked unreachable (backing off)")
        try:
            handle = await self._get_handle()
            timeout = timeout or self.call_timeout_s
            if not self._answered:
                timeout = max(timeout, self.first_call_timeout_s)
            result = await asyncio.wait_for(getattr(handle, method).remote(*args), timeout)
        except (RayActorError, GetTimeoutError, asyncio.TimeoutError, ValueError) as e:
            # ValueError: ray.get_actor found no such actor.
            self._fault()
            raise CapacityUnavailable(f"capacity actor unreachable: {type(e).__name__}: {e}") from e
        self.faults = 0
        self._answered = True
        return result

    async def _send(self, ops: list, timeout: float | None = None, remake=None) -> list:
        """One batch, applied in order: over the direct connection when it is up, else as a Ray
        call. `remake()` -> (ops, timeout) rebuilds a waiting hold for the time it has left."""
        if self.transport != "ray":
            conn = self._fast_conn()
            if conn is not None:
                try:
                    out = await conn.request(ops, timeout or self.call_timeout_s)
                except FastUnsendable:
                    pass                         # this batch only; the connection is fine
                except FastFailed as e:
                    self.fast_link.fault(conn, e)
                    if remake is not None:
                        ops, timeout = remake()
                else:
                    self.fast_link.answered()
                    return out
        self.ray_batches += 1
        return await self._call("apply", ops, timeout=timeout)

    @property
    def fast_batches(self) -> int:
        return self.fast_link.batches

    @property
    def fast_faults(self) -> int:
        return self.fast_link.faults

    def _fast_conn(self) -> FastConnection | None:
        """The direct connection for this batch, if one is up (see capacity/fast_link.py)."""
        if not self._answered or self.faults or time.monotonic() < self._down_until:
            return None       # the first call goes through Ray (it may create the actor), and
                              # while Ray calls fail, discovery would only fail with them
        return self.fast_link.conn()

    async def _discover_endpoint(self) -> dict | None:
        # Not through _call: a failed discovery must not count as a Ray fault (that would back
        # off, or send to the local fallback, calls that Ray can still carry).
        handle = await self._get_handle()
        return await asyncio.wait_for(handle.endpoint.remote(), self.call_timeout_s)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)            # asyncio keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Close this loop's direct connection (Ray handles need no closing)."""
        self.fast_link.close()

    # ---- routing path ---------------------------------------------------------------------

    async def hold(self, model_id: str, raw_tokens: int, request_id: str,
                   prompt_tokens: int | None = None, exclude=(), wait_s: float = 0.0) -> Hold:
        """Debit the best replica; raises CapacityRefused (nothing debited) when none fits.

        wait_s > 0: when no replica fits, wait up to wait_s in the model's FIFO at the actor and
        be granted in arrival order as capacity frees up; the same "no_capacity" refusal when the
        wait runs out. Cancelling the awaiting task cancels the wait at the actor (never granted
        later)."""
        op = ("hold", model_id, raw_tokens, request_id, prompt_tokens, tuple(exclude))
        try:
            if wait_s and wait_s > 0:
                out = await self._waiting_hold(op, float(wait_s))
            else:
                out = await self._report(op)
        except CapacityUnavailable:
            return self._local.hold(model_id, raw_tokens, request_id)
        if not out["ok"]:
            raise CapacityRefused(out["reason"], out["retry_after_s"], out.get("detail", ""))
        hold = out["hold"]
        return Hold(**hold) if isinstance(hold, dict) else hold   # direct transport: a dict

    async def _waiting_hold(self, op: tuple, wait_s: float) -> dict:
        """A waiting hold goes alone (its reply may come late) and bypasses the batch queue."""
        deadline = time.monotonic() + wait_s

        def remake():
            left = max(0.0, deadline - time.monotonic())
            return [(*op, left)], left + self.call_timeout_s

        ops, timeout = remake()
        try:
            return _checked(op, (await self._send(ops, timeout, remake))[0])
        except (asyncio.CancelledError, CapacityUnavailable):
            # The caller gave up, or we could not hear the answer: the hold may still be parked
            # (or granted) at the actor. Cancel it there, on the same path, in order.
            self._spawn(self._quietly(self._report(("cancel", op[3]))))
            raise

    @staticmethod
    async def _quietly(coro) -> None:
        try:
            await coro
        except Exception:  # noqa: BLE001 - best effort; the hold TTL is the backstop
            pass

    # ---- reports (batched) ----------------------------------------------------------------

    async def commit(self, request_id: str, replica_id: str, raw_tokens: int | None = None,
                     model_id: str | None = None) -> bool:
        if self._local.holds(request_id):
            return True
        return await self._report(("commit", request_id, replica_id, raw_tokens, model_id))

    async def release(self, request_id: str, telemetry: RequestTelemetry | dict | None = None) -> bool:
        if self._local.settle(request_id):
            return True
        return await self._report(("release", request_id, _dump(telemetry)))

    async def cancel(self, request_id: str) -> bool:
        if self._local.settle(request_id):
            return True
        return await self._report(("cancel", request_id))

    async def retire(self, replica_ids: list[str]) -> int:
        """Tell the actor these replicas are gone (their holds are dropped at once)."""
        return await self._report(("retire", list(replica_ids)))

    async def heartbeat(self, report: HeartbeatReport | dict) -> dict:
        out = await self._report(("heartbeat", _dump(report)))
        if isinstance(out, dict) and out.get("caps"):
            self.caps.update(out["caps"])
        return out

    async def _report(self, op: tuple) -> Any:
        return _checked(op, await self._batcher.submit(op))

    async def flush(self) -> None:
        """Wait until every queued call has been sent and answered."""
        await self._batcher.flush()

    # ---- feed -----------------------------------------------------------------------------

    async def snapshot(self) -> dict:
        """Public capacity feed (same headroom function as routing). Raises CapacityUnavailable."""
        return await self._call("snapshot")

    async def info(self) -> ActorInfo | None:
        """What the actor advertises (for capability negotiation); None when unreachable."""
        try:
            return ActorInfo.model_validate(await self._call("info"))
        except CapacityUnavailable:
            return None
