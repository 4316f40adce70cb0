"""The per-model deployment: one engine per replica, streaming deltas to the ingress.

The engine owns its thread; this shim translates calls, reports to the capacity actor
(commit on arrival, release with telemetry at the end, sequence-numbered heartbeats), exposes
routing stats and replica metadata to Serve, and drains on shutdown, handing its prefix cache to
another replica (serve_app/handoff.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from serve_app.calls import GenerateCall, stamp
from serve_app.capacity_link import CapacityLink
from serve_app.errors import from_exception
from serve_app.handoff import Handoff
from serve_app.heartbeat import ReplicaIdentity, RequestMeter, build_report
from serve_app.prefix_affinity import PrefixReport
from serve_app.wire import ReplicaDelta, ReplicaError, ReplicaItem

if TYPE_CHECKING:
    from capacity.protocol import HeartbeatReport
    from serve_app.config import CapacitySettings, ModelConfig

log = logging.getLogger("orchard.server")

# A step on a loaded Mac takes well under a second; a minute without one while requests wait
# means the engine thread is stuck (a hung kernel, a deadlock), not slow.
WEDGE_TIMEOUT_S = 60.0
# How often a replica asks whether the ingress replicas it streams to still exist: a request
# whose ingress died is cancelled within this (plus one step), its slot and hold freed.
CALLER_CHECK_S = 0.5
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "config.json", "generation_config.json")


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (in-process use, tests, bench)
        return f"local-{uuid.uuid4().hex[:8]}"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


class ModelServer:
    """Engine + capacity reporting for one model replica (usable in-process as well).

    It is the ReplicaReporter its CapacityLink reports for (serve_app/capacity_link.py)."""

    def __init__(self, model: "ModelConfig", kv_format: str, capacity: "CapacitySettings | None",
                 drain_timeout_s: float):
        """`model`: its config with the planned KV budget (serve_app.memory_plan.with_kv_budgets)."""
        self.model_id = model.id
        self.model_path = model.path
        self.drain_timeout_s = drain_timeout_s
        t0, init_unix = time.monotonic(), time.time()
        self.engine = self._make_engine(model.engine_config(kv_format))
        # Where this replica's start-up went (`info()`): a replacement's start-up is most of the
        # service's recovery after a lost replica. Wall-clock stamps compare across processes.
        self.startup: dict[str, float] = {"init_unix": init_unix,
                                          "engine_s": time.monotonic() - t0}
        self.warmup_solo_tps: list[float] = []   # set by the warm-up (prepare)
        self.replica_id = _replica_id()
        self.node_id = _node_id()
        # The engine's format and prefill mode are fixed once loaded: the identity is too. The
        # model's weights and this box's measured bandwidth feed the actor's anomaly check.
        t0 = time.monotonic()
        self.identity = ReplicaIdentity.of(self.replica_id, self.node_id, self.model_id,
                                           self.engine.format_identity,
                                           self.engine.stats().prefill_mode,
                                           model=self.engine.loaded.model)
        self.startup["identity_s"] = time.monotonic() - t0
        self.capacity = CapacityLink(capacity, self) if capacity is not None else None
        self._started = False
        self.wedge_timeout_s = WEDGE_TIMEOUT_S
        self._progress = (0, time.monotonic())   # (engine steps, when they last changed)
        self._inflight: dict[str, int] = {}   # request id -> raw tokens
        self._callers: dict[str, str] = {}    # request id -> its ingress's Ray actor name
        self._watch: Any = None               # the task cancelling requests of dead callers
        self.prefix_report = PrefixReport(self.engine)
        # Hands the prefix cache to another replica on drain, takes those others leave.
        self.handoff = Handoff.for_replica(self.engine, self.model_id, self.replica_id, capacity)

    def _make_engine(self, engine_cfg: Any) -> Any:
        from engine import Engine
        from serve_app.step_log import step_log_from_env

        return Engine(engine_cfg, trace=step_log_from_env())

    async def start(self) -> None:
        """Start background reporting on the caller's event loop (idempotent)."""
        if self._started:
            return
        self._started = True
        if self.capacity is not None:
            await self.capacity.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_callers())
        if self.handoff is not None:
            self.handoff.start()

    async def _watch_callers(self) -> None:
        """Cancel the requests of ingress replicas that are gone. Ray does not cancel an actor
        task whose caller died, so without this the request would run to its end on the
        engine, holding its slot and its capacity hold for a reader that no longer exists."""
        while True:
            await asyncio.sleep(CALLER_CHECK_S)
            for name in set(self._callers.values()):
                if await asyncio.to_thread(_actor_alive, name):
                    continue
                gone = [rid for rid, c in self._callers.items() if c == name]
                log.warning("caller %s is gone: cancelling its %d request(s)", name, len(gone))
                for rid in gone:
                    self._callers.pop(rid, None)
                    self.engine.cancel(rid)

    async def prepare(self, warmup: bool) -> None:
        """Warm up (short when the capacity actor already knows this identity's decode profile
        on this chip class), then start reporting: the first heartbeat reaches the actor before
        Serve routes to this replica."""
        if warmup:
            known = self.capacity is not None and await self.capacity.client.knows_step_profile(
                self.model_id, self.identity.chip_class, self.identity.execution)
            from engine.warmup import warm_up

            done = await warm_up(self.engine, batch=8, profile_known=known)
            self.startup["warmup_s"] = done["seconds"]
            self.startup["warmup_batch"] = done["batch"]
            self.warmup_solo_tps = done["solo_decode_tps"]   # solo samples for the actor
            log.info("%s warmed up in %.1f s (%s); decode step profile %s", self.model_id,
                     done["seconds"], "profile known" if known else "profile measured",
                     done["decode_step_profile"])
        await self.start()
        self.startup["ready_unix"] = time.time()

    # --- requests -----------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[ReplicaItem]:
        """Stream ReplicaDeltas; an error before the first delta comes as one ReplicaError."""
        stamp(call.trace, "replica_in")
        await self.start()
        meter = self._admit(call)
        try:
            try:
                async for d in self.engine.generate(call.engine_request(), coalesce=True):
                    yield self._replica_delta(d, call, first=meter.saw(d))
            except Exception as e:  # noqa: BLE001 - mapped once to an HTTP error
                if meter.deltas:
                    raise
                err = from_exception(e)
                if err.status >= 500 and err.code == "internal_error":
                    log.exception("request %s failed", call.request.request_id)
                meter.finish = f"refused:{err.reason}"
                yield ReplicaError(err.to_wire())
        finally:
            self._settle(call, meter)

    def _admit(self, call: GenerateCall) -> RequestMeter:
        """Count the request in flight and commit its hold; the meter starts now."""
        started, rid = time.monotonic(), call.request.request_id
        self._inflight[rid] = call.raw_tokens
        if call.caller:
            self._callers[rid] = call.caller
        if self.capacity is not None:
            # Off the first-token path: the client sends reports in order, so this commit
            # still reaches the actor before this request's release.
            self.capacity.commit_soon(rid)
        return RequestMeter(len(call.request.prompt_ids),
                            self.engine.stats().num_requests_running, started)

    def _replica_delta(self, d: Any, call: GenerateCall, first: bool) -> ReplicaDelta:
        """The engine delta as it is; the first also carries the replica id and the trace."""
        if first and call.trace is not None:
            stamp(call.trace, "replica_first_delta")
            call.trace["engine_ttft_s"] = d.ttft_s
        return ReplicaDelta(d, self.replica_id if first else None,
                            call.trace if first else None)

    def _settle(self, call: GenerateCall, meter: RequestMeter) -> None:
        """However the request ended: forget it, cancel it, release its hold with telemetry."""
        rid = call.request.request_id
        self._inflight.pop(rid, None)
        self._callers.pop(rid, None)
        # Safe at any point and idempotent: covers client disconnects mid-stream.
        self.engine.cancel(rid)
        if self.capacity is not None:
            self.capacity.release_soon(rid, meter.telemetry(
                self.engine.stats().num_requests_running, self.identity.execution))

    async def info(self) -> dict:
        """Model facts the ingress needs: context limit, identity, tokenizer files."""
        await self.start()
        files = {}
        for name in TOKENIZER_FILES:
            path = os.path.join(self.model_path, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    files[name] = f.read()
        return {"model_id": self.model_id, "replica_id": self.replica_id, "pid": os.getpid(),
                "format_identity": self.engine.format_identity,
                "max_model_len": self.max_model_len(),
                # The most raw tokens one request can ever be charged on an idle replica (its
                # whole KV budget): the ingress refuses larger ones at once (413).
                "max_request_tokens": int(self.engine.cost_model().max_raw_tokens(0, 0)),
                # n > 1 choices share the prompt's pages only through the prefix cache.
                "prefix_caching": bool(self.engine.cfg.enable_prefix_caching),
                "startup": dict(self.startup),
                "tokenizer_files": files}

    def max_model_len(self) -> int:
        """Most raw tokens (prompt + completion) one request may have on this replica."""
        return int(self.engine.cost_model().token_limit)

    # --- ReplicaReporter (what the capacity link reports) -------------------------------

    def active_raw_tokens(self) -> dict[str, int]:
        """Requests this replica is serving now -> raw tokens (the heartbeat's active list)."""
        return dict(self._inflight)

    def heartbeat_report(self, incarnation: int, seq: int) -> "HeartbeatReport":
        return build_report(self.identity, self.engine.stats(), self.engine.cost_model(),
                            self.active_raw_tokens(), incarnation, seq,
                            warmup_solo_tps=self.warmup_solo_tps)

    # --- Serve hooks --------------------------------------------------------------------

    def routing_stats(self) -> dict:
        stats = self.engine.stats()
        cost = self.engine.cost_model()
        used = stats.kv_bytes_reserved
        running = stats.num_requests_running
        return {
            "model_id": self.model_id,
            "format_identity": self.engine.format_identity,
            "num_requests_running": running,
            "num_requests_waiting": stats.num_requests_waiting,
            "kv_bytes_used": stats.kv_bytes_used,
            "kv_bytes_total": stats.kv_bytes_total,
            "kv_pages_used": stats.kv_pages_used,
            "kv_pages_total": stats.kv_pages_total,
            "headroom_raw_tokens": int(cost.max_raw_tokens(used, running)),
            "inflight": len(self._inflight),
            # What the prefix cache holds, for the router's prefix affinity.
            "prefix": self.prefix_report(),
        }

    async def record_routing_stats(self) -> dict:
        await self.start()
        return self.routing_stats()

    def record_replica_metadata(self) -> dict:
        return {"model_id": self.model_id, "replica_id": self.replica_id,
                "chip_class": self.identity.chip_class, "memory_bytes": _memory_bytes(),
                "format_identity": self.engine.format_identity, "node_id": self.node_id,
                "node_ip": _node_ip(),
                "kv_format_negotiation": getattr(self, "kv_format_reason", "")}

    async def check_health(self) -> None:
        """Serve replaces the replica when this raises: a dead engine thread, or a wedged one
        (work queued but no step completed for wedge_timeout_s)."""
        if not self.engine.healthy():
            raise RuntimeError(f"engine of {self.model_id} on {self.replica_id} is not healthy")
        stats = self.engine.stats()
        steps, now = stats.steps_total, time.monotonic()
        busy = stats.num_requests_running + stats.num_requests_waiting
        if steps != self._progress[0] or not busy:
            self._progress = (steps, now)
        elif now - self._progress[1] > self.wedge_timeout_s:
            raise RuntimeError(f"engine of {self.model_id} on {self.replica_id} made no step "
                               f"in {now - self._progress[1]:.0f} s with {busy} requests queued")

    def shutdown(self) -> None:
        """Graceful drain: stop reporting, let running requests finish, stop the engine."""
        if self.capacity is not None:
            self.capacity.stop()
        if self._watch is not None:
            self._watch.cancel()
        if self.handoff is not None:   # Serve stopped routing here and waited for the requests
            self.handoff.drain()
        self.engine.shutdown(drain_timeout_s=self.drain_timeout_s)

    def __del__(self):
        # Serve calls __del__ during graceful shutdown; never raise from it.
        try:
            if getattr(self, "engine", None) is not None:
                self.shutdown()
        except Exception:  # noqa: BLE001
            log.exception("drain failed")


def _actor_alive(name: str) -> bool:
    """Whether the named actor (in Serve's namespace) still exists. A Serve replica is never
    restarted under its name (Serve starts a new one), so a lookup that fails means gone; any
    other failure (GCS busy) counts as alive: cancelling a live client's request is worse than
    finishing an orphan."""
    try:
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        ray.get_actor(name, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False
    except Exception:  # noqa: BLE001
        return True


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001
        return ""


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    except Exception:  # noqa: BLE001
        return "local"

