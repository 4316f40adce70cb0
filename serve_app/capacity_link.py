"""A replica's link to the capacity actor: commit, release with telemetry, heartbeats.

Never fails a request because the actor is unreachable: the engine still admits by its own
byte ledger, and the actor rebuilds its view from the next heartbeat. The link knows its replica
only as a ReplicaReporter (what it reports), so the dependency points one way.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Protocol

from capacity.errors import ProtocolError

if TYPE_CHECKING:
    from capacity.protocol import HeartbeatReport, RequestTelemetry
    from serve_app.capacity_client import CapacityClient
    from serve_app.config import CapacitySettings

log = logging.getLogger("orchard.capacity_link")

# Least time between two heartbeats when releases call for one early (CapacityLink.nudge): a
# burst of request ends costs one report per spacing, not one each.
NUDGE_SPACING_S = 0.05


class ReplicaReporter(Protocol):
    """What a CapacityLink needs from its replica (serve_app.server.ModelServer has it)."""

    replica_id: str
    model_id: str

    def active_raw_tokens(self) -> dict[str, int]:
        """Requests being served now -> raw tokens."""

    def heartbeat_report(self, incarnation: int, seq: int) -> "HeartbeatReport":
        """The replica's sequence-numbered heartbeat (serve_app/heartbeat.py)."""


def make_client(settings: "CapacitySettings") -> "CapacityClient":
    """A CapacityClient for these settings; it creates the actor the same way if it is gone."""
    from serve_app.capacity_client import CapacityClient

    return CapacityClient(namespace=settings.namespace, snapshot_path=settings.snapshot_path,
                          config=settings.actor_config(),
                          resources=settings.actor_resources or None)


class CapacityLink:
    def __init__(self, settings: "CapacitySettings", reporter: ReplicaReporter):
        self.settings = settings
        self.reporter = reporter
        self.client = make_client(settings)
        self.interval_s = settings.heartbeat_interval_s
        self.incarnation = int(time.time() * 1000)
        self.seq = 0
        self._task: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()
        self._nudged = asyncio.Event()
        self.heartbeats_sent = 0
        self.faults = 0

    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._nudged.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._nudged.clear()
            await self.beat()
            await asyncio.sleep(NUDGE_SPACING_S)   # nudges meanwhile share the next beat

    def nudge(self) -> None:
        """Heartbeat soon instead of at the next interval. The actor counts a replica's running
        requests (its concurrency slots) and KV bytes from heartbeats only, so after requests
        end, holds queued for this replica wait for the next report: up to a whole interval
        (2 s by default) of an idle engine under a full queue (seen on the H200: 1.7 s between
        one wave of 32 ending and the next 16 arriving)."""
        self._nudged.set()

    async def beat(self) -> None:
        self.seq += 1
        try:
            await self.client.heartbeat(self.reporter.heartbeat_report(self.incarnation, self.seq))
            self.heartbeats_sent += 1
        except Exception:  # noqa: BLE001 - the next beat retries
            self.faults += 1
            log.warning("heartbeat %d failed", self.seq, exc_info=True)

    async def commit(self, request_id: str) -> bool:
        try:
            # raw tokens and model let a restarted actor re-establish the reservation.
            await self.client.commit(request_id, self.reporter.replica_id,
                                     self.reporter.active_raw_tokens().get(request_id),
                                     self.reporter.model_id)
            return True
        except Exception as e:  # noqa: BLE001 - unknown when routed without a hold (fallback)
            log.debug("commit %s: %s", request_id, e)
            return False

    def commit_soon(self, request_id: str) -> None:
        self._spawn(self.commit(request_id))

    def release_soon(self, request_id: str, telemetry: "RequestTelemetry") -> None:
        """Release from a `finally` that may run during cancellation: schedule, don't await."""
        self._spawn(self._release(request_id, telemetry))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)   # keep a reference until done (asyncio holds tasks weakly)
        task.add_done_callback(self._pending.discard)

    async def _release(self, request_id: str, telemetry: "RequestTelemetry") -> None:
        try:
            await self.client.release(request_id, telemetry)
        except Exception:  # noqa: BLE001
            log.warning("release of %s failed", request_id, exc_info=True)
        # After the release (reports travel in order): the report that frees its slot and
        # bytes must not reach the actor while the actor still holds the request as committed.
        self.nudge()


# Between asks while the capacity actor does not answer (it may still be starting).
NEGOTIATION_RETRY_S = (0.5, 1.0, 2.0, 5.0)


async def negotiate_format(requested: str, settings: "CapacitySettings | None"
                          ) -> tuple[str, str]:
    """Confirm a packed KV format with the capacity actor before the replica becomes ready.

    Retries (with a log line each time) while the actor is unreachable and raises ProtocolError
    when it answers but cannot keep per-format histories: the replica never serves a format its
    config did not ask for.
    """
    from capacity.protocol import ActorUnreachable, negotiate_kv_format

    if requested == "native":
        return requested, "no negotiation needed"
    if settings is None:
        raise ProtocolError(f"KV format {requested!r} needs the capacity actor to confirm "
                            "per-format histories, and no capacity settings were given")
    client = make_client(settings)
    for attempt in itertools.count():
        try:
            n = negotiate_kv_format(requested, await client.info())
            return n.kv_format, n.reason
        except ActorUnreachable as e:
            wait = NEGOTIATION_RETRY_S[min(attempt, len(NEGOTIATION_RETRY_S) - 1)]
            log.warning("%s; not ready, asking again in %.1f s (attempt %d)", e, wait,
                        attempt + 1)
            await asyncio.sleep(wait)
    raise AssertionError("itertools.count() never ends")


def identity_rows(snapshot: dict) -> list[dict]:
    """(model, identity, cap, learned rates) rows from the public capacity feed, for /metrics."""
    rows = []
    for model in snapshot.get("models", []) if isinstance(snapshot, dict) else []:
        for ident in model.get("identities", []):
            rows.append({"model_id": model.get("model_id"), "identity": ident.get("identity"),
                         "cap": ident.get("cap"), "decode_tokens_per_s": ident.get("decode_tps"),
                         "prefill_tokens_per_s": ident.get("prefill_tps")})
    return rows
