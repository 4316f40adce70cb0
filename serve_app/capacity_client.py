"""The client replicas and routers use to reach the capacity actor (capacity/actor.py).

It batches operations (capacity/operations.py) without a timer, sends each batch over the direct
connection when one is up and as a Ray call otherwise, and admits locally under a conservative
cap while the actor is unreachable.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from capacity.actor import DEFAULT_NAME, DEFAULT_NAMESPACE, get_or_create_actor
from capacity.errors import CapacityError, CapacityRefused, CapacityUnavailable
from capacity.fleet import Hold
from capacity.operations import (CancelOp, CommitOp, HeartbeatOp, HoldOp, Op, ReleaseOp,
                                 RetireOp, encode_op)
from capacity.protocol import ActorInfo, HeartbeatReport, RequestTelemetry
from capacity.transport.fast_link import FastLink
from capacity.transport.fastpath import FastConnection, FastFailed, FastUnsendable
from capacity.transport.local_admissions import LocalAdmissions
from capacity.transport.report_batcher import ReportBatcher


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def _checked(op: Op, result: Any) -> Any:
    """An op the actor rejected as malformed comes back as {"error": ...}: raise it here."""
    if isinstance(result, dict) and "error" in result:
        raise CapacityError(f"{op.name} rejected: {result['error']}: {result.get('detail', '')}")
    return result


class CapacityClient:
    """Caches the actor handle and the last caps, batches reports, and falls back to a conservative
    local cap when the actor is unreachable (so an actor outage degrades admission, not serving).

    Calls (hold/commit/release/cancel/heartbeat) are batched without a timer
    (capacity/transport/report_batcher.py); each batch is applied in order.

    Transport (`transport="auto"`, the default): after its first Ray call the client asks the actor
    for its direct endpoint in the background and from then on sends batches over one persistent
    connection per event loop (capacity/transport/fastpath.py). Any failure there (connection
    lost, timeout, refused token) sends that batch through Ray instead and rediscovers the
    endpoint after a backoff (the actor may have restarted on a new port with a new token). `transport="ray"`
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

    async def _send(self, ops: list[Op], timeout: float | None = None, remake=None) -> list:
        """One batch, applied in order: over the direct connection when it is up, else as a Ray
        call. `remake()` -> (ops, timeout) rebuilds a waiting hold for the time it has left."""
        if self.transport != "ray":
            conn = self._fast_conn()
            if conn is not None:
                try:
                    out = await conn.request([encode_op(op) for op in ops],
                                             timeout or self.call_timeout_s)
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
        return await self._call("apply", [encode_op(op) for op in ops], timeout=timeout)

    @property
    def fast_batches(self) -> int:
        return self.fast_link.batches

    @property
    def fast_faults(self) -> int:
        return self.fast_link.faults

    def _fast_conn(self) -> FastConnection | None:
        """The direct connection for this batch, if one is up (see capacity/transport/fast_link.py)."""
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
                   prompt_tokens: int | None = None, exclude=(), wait_s: float = 0.0,
                   affine: bool = False, saved_tokens: int = 0) -> Hold:
        """Debit the best replica; raises CapacityRefused (nothing debited) when none fits.

        wait_s > 0: when no replica fits, wait up to wait_s in the model's FIFO at the actor and
        be granted in arrival order as capacity frees up; the same "no_capacity" refusal when the
        wait runs out. Cancelling the awaiting task cancels the wait at the actor (never granted
        later). affine (with wait_s): wait for the replicas not in `exclude` only, beside the
        FIFO rather than in it (capacity/waiting.py), for about the prefill of `saved_tokens`
        (the prefix they cache) at most (capacity/affine_bound.py)."""
        op = HoldOp(model_id, raw_tokens, request_id, prompt_tokens, tuple(exclude), 0.0, affine,
                    saved_tokens)
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

    async def _waiting_hold(self, op: HoldOp, wait_s: float) -> dict:
        """A waiting hold goes alone (its reply may come late) and bypasses the batch queue."""
        deadline = time.monotonic() + wait_s

        def remake():
            left = max(0.0, deadline - time.monotonic())
            return [op.waiting(left)], left + self.call_timeout_s

        ops, timeout = remake()
        try:
            return _checked(op, (await self._send(ops, timeout, remake))[0])
        except (asyncio.CancelledError, CapacityUnavailable):
            # The caller gave up, or we could not hear the answer: the hold may still be parked
            # (or granted) at the actor. Cancel it there, on the same path, in order.
            self._spawn(self._quietly(self._report(CancelOp(op.request_id))))
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
        return await self._report(CommitOp(request_id, replica_id, raw_tokens, model_id))

    async def release(self, request_id: str, telemetry: RequestTelemetry | None = None) -> bool:
        if self._local.settle(request_id):
            return True
        return await self._report(ReleaseOp(request_id, telemetry))

    async def cancel(self, request_id: str) -> bool:
        if self._local.settle(request_id):
            return True
        return await self._report(CancelOp(request_id))

    async def retire(self, replica_ids: list[str]) -> int:
        """Tell the actor these replicas are gone (their holds are dropped at once)."""
        return await self._report(RetireOp(list(replica_ids)))

    async def heartbeat(self, report: HeartbeatReport | dict) -> dict:
        out = await self._report(HeartbeatOp(_dump(report)))
        if isinstance(out, dict) and out.get("caps"):
            self.caps.update(out["caps"])
        return out

    async def _report(self, op: Op) -> Any:
        return _checked(op, await self._batcher.submit(op))

    async def flush(self) -> None:
        """Wait until every queued call has been sent and answered."""
        await self._batcher.flush()

    # ---- feed -----------------------------------------------------------------------------

    async def snapshot(self) -> dict:
        """Public capacity feed (same headroom function as routing). Raises CapacityUnavailable."""
        return await self._call("snapshot")

    async def knows_step_profile(self, model_id: str, chip_class: str | None,
                                 execution: str | None) -> bool:
        """Whether the actor has this identity's decode step profile (False when unreachable:
        the replica then measures it)."""
        try:
            return bool(await self._call("knows_step_profile", model_id, chip_class, execution))
        except CapacityUnavailable:
            return False

    async def info(self) -> ActorInfo | None:
        """What the actor advertises (for capability negotiation); None when unreachable."""
        try:
            return ActorInfo.model_validate(await self._call("info"))
        except CapacityUnavailable:
            return None
