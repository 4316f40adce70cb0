"""CapacityRouter: hold a reservation in the capacity actor, then route by its ranking.

Runs inside every caller of a model deployment (the ingress replicas). Per request it makes one
actor round trip (`hold`), which debits routing headroom and the public feed together and ranks
replicas by headroom and learned rates; without room it queues at the actor (FIFO, up to
`queue_timeout_s`), and a refusal propagates to the ingress as 429/503. The
replica commits the hold on arrival and releases it with telemetry at the end. After repeated
actor faults the router routes by power-of-two choices (ranked by reported headroom) for a
cool-down period, so an actor outage degrades routing quality, not availability.

Prefix affinity (`prefix_routing`, on by default): before the ordinary hold, a request whose
prompt's leading pages some replica already caches (for the request's tenant) holds on the
replicas holding the longest such prefix only (the others excluded), so the actor still enforces
every cap and never ranks a dead replica. When none of them has room it waits for them on the
actor's affine list (beside the FIFO, never blocking it: capacity/waiting.py) for about the
prefill time the cached prefix saves at their learned rate (capacity/affine_bound.py; 2 s while
unlearned), within queue_timeout_s, the deadline and `prefix_wait_s` when set; then the ordinary
hold routes by headroom. serve_app/prefix_affinity.py keeps the view of the caches.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from capacity.errors import CapacityRefused
from serve_app import router_registry
from serve_app.calls import GenerateCall, stamp
from serve_app.capacity_link import make_client
from serve_app.config import CapacitySettings
from serve_app.prefix_affinity import PrefixIndex

log = logging.getLogger("ray.serve")

# Delay before a completed request's hold is cancelled as a leak guard: the replica's own
# release (with telemetry) normally lands first, and cancelling a settled hold is a no-op.
LEAK_GUARD_DELAY_S = 5.0


def _call_of(pending: PendingRequest) -> GenerateCall | None:
    for arg in pending.args:
        if isinstance(arg, GenerateCall):
            return arg
    return None


def headroom(replica: RunningReplica) -> int:
    stats = replica.routing_stats or {}
    return int(stats.get("headroom_raw_tokens", 0))


class CapacityRouter(LocalityMixin, RequestRouter):
    def initialize_state(self, capacity: dict[str, Any] | None = None, **_: Any) -> None:
        """`capacity`: serve_app.config.CapacitySettings as a dict (router kwargs are JSON)."""
        settings = CapacitySettings.model_validate(capacity or {})
        self.client = make_client(settings)
        self.max_fault_retries = settings.max_fault_retries
        self.fallback_cooldown_s = settings.fallback_cooldown_s
        self.queue_timeout_s = settings.queue_timeout_s
        self.max_queued = settings.max_queued
        self.waiting: dict[str, int] = {}   # model -> holds of this router now in the call
        self.fallback_until = 0.0
        self.consecutive_faults = 0
        self.holds: dict[str, tuple[str, Any]] = {}   # internal request id -> (request id, hold)
        self.stats = {"holds": 0, "refusals": 0, "faults": 0, "fallback_routes": 0,
                      "queue_full": 0}
        self.prefix_routing = settings.prefix_routing
        # None: no cap of its own (the actor's saved-prefill bound, within queue_timeout_s).
        self.prefix_wait_s = (float("inf") if settings.prefix_wait_s is None
                              else settings.prefix_wait_s)
        self.prefix = PrefixIndex()
        if self.prefix_routing:
            # lookups: requests routed through the actor; hits: sent to a replica caching a
            # prefix of theirs; cached_tokens: that prefix's tokens; waited: found those
            # replicas full and waited for them; wait_granted: then got one; full: got none
            # (after any wait), so headroom decided.
            self.stats.update(prefix_lookups=0, prefix_hits=0, prefix_cached_tokens=0,
                              prefix_full=0, prefix_waited=0, prefix_wait_granted=0)
        self._tasks: set[asyncio.Task] = set()
        self._live_replicas: set[str] = set()
        router_registry.register(self)

    # --- the per-request path ------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        gone, self._live_replicas = self._live_replicas - live, live
        # While the actor is unreachable the client admits locally up to this many requests
        # per model; Serve's per-replica ceiling is the honest bound then.
        self.client.fallback_cap = max(1, sum(r.max_ongoing_requests for r in replicas))
        self.prefix.forget(gone)
        if gone:
            # Serve dropped these replicas (died, or scaled away): the actor stops counting
            # them and drops their reservations now, not after its silence timeout.
            log.info("replicas gone: %s; retiring them at the capacity actor", sorted(gone))
            self._spawn(self._retire(sorted(gone)))

    async def _retire(self, replica_ids: list[str]) -> None:
        try:
            await self.client.retire(replica_ids)
        except Exception:  # noqa: BLE001 - the actor's silence timeout is the backstop
            log.warning("could not retire %s at the capacity actor", replica_ids, exc_info=True)

    async def _choose_replica_for_request(self, pending_request: PendingRequest, *,
                                          is_retry: bool = False) -> RunningReplica:
        call = _call_of(pending_request)
        if call is None or time.monotonic() < self.fallback_until:
            if call is not None:
                self.stats["fallback_routes"] += 1
            return await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
        key = pending_request.metadata.internal_request_id
        if key not in self.holds:
            stamp(call.trace, "router_in")
            started = time.monotonic()
            hold = await self._affine_hold(call) if self.prefix_routing else None
            if hold is None:
                hold = await self._hold(call, spent_s=time.monotonic() - started)
            stamp(call.trace, "router_held")
            if hold is None:
                self.stats["fallback_routes"] += 1
                return await super()._choose_replica_for_request(pending_request,
                                                                 is_retry=is_retry)
            self.holds[key] = (call.request.request_id, hold)
        replica = self._ranked_replica(self.holds[key][1], is_retry)
        if replica is not None:
            stamp(call.trace, "router_chosen")
            if self.prefix_routing and not is_retry:
                self._count_prefix(replica, call)
            return replica
        # A fallback hold (actor unreachable) ranks nothing, or the actor ranks replicas this
        # router has not seen yet: choose locally.
        self.stats["fallback_routes"] += 1
        return await super()._choose_replica_for_request(pending_request, is_retry=is_retry)

    async def _affine_hold(self, call: GenerateCall) -> Any | None:
        """A hold on the replicas caching the longest prefix of the prompt, or None (no replica
        caches any of it, or none of those has room under its cap now: headroom decides)."""
        live = {rid.unique_id: r for rid, r in self.curr_replicas.items()}
        for uid, r in live.items():
            self.prefix.observe(uid, (r.routing_stats or {}).get("prefix"))
        req = call.request
        match = self.prefix.matches(live, req.tenant, req.prompt_ids)
        best = max(match.values(), default=0)
        if best <= 0:
            return None
        exclude = [uid for uid, tokens in match.items() if tokens < best]
        try:
            hold = await self.client.hold(call.model, call.raw_tokens, req.request_id,
                                          prompt_tokens=len(req.prompt_ids), exclude=exclude)
        except CapacityRefused as e:
            hold = (await self._affine_wait(call, exclude, best) if e.reason == "no_capacity"
                    else None)
            self.stats["prefix_full"] += e.reason == "no_capacity" and hold is None
            if hold is None:
                return None
        except asyncio.CancelledError:
            self._cancel_soon(req.request_id, 0.0)
            raise
        except Exception:  # noqa: BLE001 - the ordinary hold counts faults and backs off
            return None
        if hold.fallback:
            # The client could not reach the actor and admitted locally (ranking nothing).
            self.stats["faults"] += 1
            self.consecutive_faults += 1
            if self.consecutive_faults >= self.max_fault_retries:
                self._enter_fallback()
            return hold
        self.stats["holds"] += 1
        self.consecutive_faults = 0
        if self._misses_deadline(call, hold):
            # The caching replica is cold for this deadline; the ordinary hold may rank a warm one.
            await self._cancel_now(req.request_id)
            return None
        return hold

    async def _affine_wait(self, call: GenerateCall, exclude: list[str],
                           cached: int) -> Any | None:
        """The caching replicas are full: wait for one of them (a hold), or None when the wait
        runs out, is not allowed (0 s, no time left before the deadline, this router's queue
        full) or fails. The actor bounds the wait by the prefill of the `cached` tokens a hit
        saves (capacity/affine_bound.py); this caps it by queue_timeout_s, the deadline and
        prefix_wait_s when set."""
        req, budget = call.request, min(self.prefix_wait_s, self.queue_timeout_s)
        if call.first_token_deadline_unix is not None:
            budget = min(budget, call.deadline_monotonic() - time.monotonic())
        if budget <= 0 or self.waiting.get(call.model, 0) >= self.max_queued:
            return None
        self.stats["prefix_waited"] += 1
        self.waiting[call.model] = self.waiting.get(call.model, 0) + 1
        try:
            hold = await self.client.hold(call.model, call.raw_tokens, req.request_id,
                                          prompt_tokens=len(req.prompt_ids), exclude=exclude,
                                          wait_s=budget, affine=True, saved_tokens=cached)
        except CapacityRefused:
            return None
        except Exception:  # noqa: BLE001 - e.g. an actor older than affine waits: headroom
            return None
        finally:
            self.waiting[call.model] -= 1
        self.stats["prefix_wait_granted"] += not hold.fallback
        return hold

    def _count_prefix(self, replica: RunningReplica, call: GenerateCall) -> None:
        uid = replica.replica_id.unique_id
        self.stats["prefix_lookups"] += 1
        self.prefix.observe(uid, (replica.routing_stats or {}).get("prefix"))
        req = call.request
        cached = self.prefix.matches([uid], req.tenant, req.prompt_ids)[uid]
        if cached:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_cached_tokens"] += cached
        self.prefix.routed(uid, self.prefix.request_keys(uid, req.tenant, req.prompt_ids))

    async def _hold(self, call: GenerateCall, spent_s: float = 0.0) -> Any | None:
        """The actor's hold, or None after repeated faults (then power-of-two for a while).

        When no replica has room the hold waits in the actor's per-model FIFO for up to
        queue_timeout_s less `spent_s` (an affine wait already spent; never past the request's
        first-token deadline) and is granted in arrival order as capacity frees; "no_capacity"
        then means the wait ran out. While
        max_queued holds of this router already wait for the model, a newcomer does not queue:
        it is refused at once (a full queue refuses rather than grows without bound).
        """
        req, budget = call.request, self.queue_timeout_s - spent_s
        if call.first_token_deadline_unix is not None:
            budget = min(budget, call.deadline_monotonic() - time.monotonic())
        budget = max(0.0, budget)
        if budget and self.waiting.get(call.model, 0) >= self.max_queued:
            self.stats["queue_full"] += 1
            budget = 0.0
        while True:
            self.waiting[call.model] = self.waiting.get(call.model, 0) + 1
            try:
                hold = await self.client.hold(call.model, call.raw_tokens, req.request_id,
                                              prompt_tokens=len(req.prompt_ids), wait_s=budget)
                if not hold.fallback:
                    self.consecutive_faults = 0
                    self.stats["holds"] += 1
                    if self._misses_deadline(call, hold):
                        # The cold bound of an unmeasured identity already exceeds the time
                        # left: refuse now, with the hold cancelled, rather than serve late.
                        await self._cancel_now(req.request_id)
                        raise CapacityRefused(
                            "deadline_unreachable", max(1.0, hold.predicted_ttft_s),
                            f"first token forecast at >= {hold.predicted_ttft_s:.1f} s (cold, "
                            f"unmeasured), beyond the request's first-token deadline")
                    return hold
                # The client could not reach the actor and admitted locally.
                self.stats["faults"] += 1
                self.consecutive_faults += 1
                if self.consecutive_faults >= self.max_fault_retries:
                    self._enter_fallback()
                return hold
            except CapacityRefused as e:
                if e.reason == "unknown_model" and self.curr_replicas:
                    # We see replicas the actor does not: it restarted and has not heard their
                    # heartbeats yet. Route without it rather than refuse.
                    self.stats["faults"] += 1
                    return None
                self.stats["refusals"] += 1
                raise
            except asyncio.CancelledError:
                self._cancel_soon(req.request_id, 0.0)
                raise
            except Exception:  # noqa: BLE001 - a misbehaving actor or client
                self.stats["faults"] += 1
                self.consecutive_faults += 1
                log.warning("capacity hold failed (fault %d)", self.consecutive_faults,
                            exc_info=True)
                if self.consecutive_faults >= self.max_fault_retries:
                    self._enter_fallback()
                    return None
                await self._backoff(self.consecutive_faults - 1)
            finally:
                self.waiting[call.model] -= 1

    @staticmethod
    def _misses_deadline(call: GenerateCall, hold: Any) -> bool:
        deadline = call.deadline_monotonic()
        return deadline is not None and hold.misses_deadline(deadline - time.monotonic())

    async def _cancel_now(self, request_id: str) -> None:
        """Settle a hold this router will not use before answering, so a refusal debits nothing."""
        try:
            await self.client.cancel(request_id)
        except Exception:  # noqa: BLE001 - the actor is gone: its TTL reaper settles the hold
            log.warning("could not cancel hold %s", request_id, exc_info=True)

    def _enter_fallback(self) -> None:
        self.fallback_until = time.monotonic() + self.fallback_cooldown_s
        self.consecutive_faults = 0
        log.warning("capacity actor faulted %d times in a row; power-of-two routing for %.0f s",
                    self.max_fault_retries, self.fallback_cooldown_s)

    def _ranked_replica(self, hold: Any, is_retry: bool) -> RunningReplica | None:
        by_uid = {rid.unique_id: r for rid, r in self.curr_replicas.items()}
        ranked = [by_uid[u] for u in hold.ranking if u in by_uid]
        if is_retry:
            # The first choice rejected us (at max_ongoing_requests); try the next ones.
            available = self.select_available_replicas(ranked)
            ranked = available or ranked[1:]
        return ranked[0] if ranked else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """Power-of-two choices, the pair ordered by reported headroom."""
        candidates = self.select_available_replicas(candidate_replicas) or candidate_replicas
        pair = random.sample(candidates, k=min(2, len(candidates)))
        return [sorted(pair, key=headroom, reverse=True)]

    # --- lifecycle hooks ---------------------------------------------------------------

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        entry = self.holds.pop(internal_request_id, None)
        if entry is not None:
            request_id, hold = entry
            # A local (fallback) hold lives in this process only: settle it now.
            self._cancel_soon(request_id, 0.0 if hold.fallback else LEAK_GUARD_DELAY_S)

    def _cancel_soon(self, request_id: str, delay_s: float) -> None:
        async def cancel():
            await asyncio.sleep(delay_s)
            try:
                await self.client.cancel(request_id)
            except Exception:  # noqa: BLE001 - already settled, or the actor is gone
                pass

        self._spawn(cancel())

    def _spawn(self, coro) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:   # no loop in this thread: the actor's TTL reaper settles it
            coro.close()
            return
        self._tasks.add(task)   # asyncio holds tasks weakly
        task.add_done_callback(self._tasks.discard)

