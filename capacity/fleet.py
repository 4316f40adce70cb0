"""The capacity actor's state machine, without Ray: heartbeats -> rates, caps and ledger; holds ranked
by calibrated TTFT; releases -> per-request samples and calibration; the public feed.

Every method is synchronous and short, so the async actor runs each to completion on its event loop:
no lock is ever held across the fleet or across an await. Pure Python; callers pass `now`.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, ValidationError

from capacity.anomaly import AnomalyConfig, DecodeObservation, check
from capacity.caps import CapConfig, CapDecision, resolve_cap
from capacity.errors import CapacityRefused, ConfigInvalid, IdentityError
from capacity.forecast import ForecastConfig, forecast_ttft
from capacity.identity import ExecutionKey, normalize_chip_class, parse_execution
from capacity.ledger import Headroom, Ledger, LedgerConfig, Replica
from capacity.protocol import (RESIDENT_STATES, ActorInfo, HeartbeatReport, RequestTelemetry,
                               check_version)
from capacity.rates import RateConfig, RateRegistry, RequestSample
from capacity.sections import Section, describe

SNAPSHOT_VERSION = 1


class FleetConfig(Section):
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    rates: RateConfig = Field(default_factory=RateConfig)
    caps: CapConfig = Field(default_factory=CapConfig)
    forecast: ForecastConfig = Field(default_factory=ForecastConfig)
    anomaly: AnomalyConfig = Field(default_factory=AnomalyConfig)

    @classmethod
    def from_dict(cls, data: dict | None) -> "FleetConfig":
        """Sections from their wire form (the actor's `config`); an unknown section or key, or
        a bad value, raises ConfigInvalid naming it."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as e:
            raise ConfigInvalid(describe(e, "capacity config")) from None


@dataclass(frozen=True)
class Hold:
    request_id: str
    model_id: str
    replica_id: str            # the replica debited; route here first
    ranking: list[str]         # candidates best first (replica_id first)
    raw_tokens: int
    predicted_ttft_s: float
    fallback: bool = False     # True: granted by the client's local cap, the actor was unreachable
    # predicted_ttft_s is the cold bound max(estimate, cold-load penalty) of an identity whose
    # prefill is unmeasured (or of a replica that must load first), not a calibrated forecast.
    ttft_bound: bool = False

    def misses_deadline(self, left_s: float | None) -> bool:
        """Whether a first-token deadline `left_s` seconds away must be refused now: the seed's
        gate on the cold bound ("unknown" is not "zero latency": a deadline shorter than the
        load alone cannot be met). Warm forecasts do not gate here; the replica's own admission
        forecast does."""
        return left_s is not None and self.ttft_bound and self.predicted_ttft_s > left_s


class Fleet:
    def __init__(self, cfg: FleetConfig | None = None, rates: RateRegistry | None = None):
        self.cfg = cfg or FleetConfig()
        self.rates = rates or RateRegistry(self.cfg.rates)
        self.ledger = Ledger(self.cfg.ledger)
        self._node_load: dict[str, dict[str, int]] = {}      # node -> replica -> running + waiting
        self._decisions: dict[tuple[str, str], CapDecision] = {}
        self._warmups_counted: set[tuple[str, int, str]] = set()   # (replica, incarnation, model)
        self._observations: dict[tuple[str, str], DecodeObservation] = {}
        self.counters = {"heartbeats": 0, "stale_heartbeats": 0, "holds": 0, "refusals": 0,
                         "replica_releases": 0, "quarantined": 0, "retired_replicas": 0}

    def info(self) -> ActorInfo:
        return ActorInfo()

    # ---- heartbeats ----------------------------------------------------------------------------

    def heartbeat(self, report: HeartbeatReport | dict, now: float) -> dict:
        if not isinstance(report, HeartbeatReport):
            report = HeartbeatReport.model_validate(report)
        check_version(report)
        if not self.ledger.accept_seq(report.replica_id, report.incarnation, report.seq):
            self.counters["stale_heartbeats"] += 1
            return {"accepted": False, "reason": "stale_or_out_of_order", "caps": {}}
        self.counters["heartbeats"] += 1
        try:
            chip = normalize_chip_class(report.chip_class)
        except IdentityError:
            chip = "invalid"
        node = report.node_id or report.replica_id
        loads = self._node_load.setdefault(node, {})
        loads[report.replica_id] = sum(s.num_running + s.num_waiting for s in report.slots)
        box_busy = sum(loads.values())
        caps = {}
        for slot in report.slots:
            key = ExecutionKey(slot.model_id, chip, slot.resolved_execution())
            if key.is_invalid:
                self.counters["quarantined"] += 1
            resident = slot.state in RESIDENT_STATES
            if resident and slot.observed_decode_tps is not None:
                solo = box_busy <= 1 and slot.num_running > 0
                self.rates.record_decode(key, slot.observed_decode_tps, solo)
            if resident and slot.decode_step_profile:
                self.rates.record_step_profile(key, slot.decode_step_profile)
            warmed = (report.replica_id, report.incarnation, slot.model_id)
            if resident and slot.warmup_solo_tps and warmed not in self._warmups_counted:
                # The warm-up's lone decode steps, same identity, before traffic: solo samples
                # (a replica re-sends them every heartbeat; they count once).
                self._warmups_counted.add(warmed)
                for tps in slot.warmup_solo_tps:
                    self.rates.record_decode(key, tps, solo=True)
            ceiling = slot.max_concurrency or (slot.cost_model.concurrency_ceiling
                                               if slot.cost_model else 1)
            decision = resolve_cap(self.rates, key, ceiling, self.cfg.caps)
            self._decisions[(slot.model_id, report.replica_id)] = decision
            self.ledger.apply_slot(report.replica_id, node, slot, key, decision.cap, now,
                                   stretchable=decision.stretchable)
            caps[slot.model_id] = decision.cap
            if (resident and slot.observed_decode_tps and report.memory_bandwidth_gbps
                    and slot.active_params and slot.bytes_per_param):
                self._observations[(slot.model_id, report.replica_id)] = DecodeObservation(
                    key, slot.observed_decode_tps, slot.num_running, report.memory_bandwidth_gbps,
                    slot.active_params, slot.bytes_per_param)
        return {"accepted": True, "reason": "ok", "caps": caps}

    # ---- reservations --------------------------------------------------------------------------

    def hold(self, model_id: str, raw_tokens: int, request_id: str, now: float,
             prompt_tokens: int | None = None, exclude=(), stretch: bool = False) -> Hold:
        """Raises CapacityRefused (nothing debited) when no replica fits."""
        prompt = raw_tokens if prompt_tokens is None else prompt_tokens
        forecasts, by_key = {}, {}

        def rank(rep: Replica, room: Headroom):
            # One forecast per (identity, state): replicas of one identity share it.
            # Heartbeats carry no queued-prefill count; load enters through free slots below.
            f = by_key.get((rep.key, rep.state))
            if f is None:
                f = by_key[(rep.key, rep.state)] = forecast_ttft(
                    self.rates, rep.key, prompt, state=rep.state, cfg=self.cfg.forecast)
            forecasts[rep.replica_id] = f
            return (f.seconds, -room.requests, rep.replica_id)

        # Holding an id that is still active returns its reservation (the ledger is
        # idempotent): Serve re-routing a request before its first hold settled. Counted once,
        # so holds and settlements balance exactly.
        again = self.ledger.reservation(request_id) is not None
        try:
            res, ranking = self.ledger.hold(model_id, raw_tokens, request_id, now, exclude, rank,
                                            stretch)
        except CapacityRefused:
            self.counters["refusals"] += 1
            raise
        if not again:
            self.counters["holds"] += 1
        f = forecasts.get(res.replica_id)
        if f is not None and f.trainable:
            res.predicted_ttft_s = f.raw_s
        return Hold(request_id, model_id, res.replica_id, ranking, res.raw_tokens,
                    f.seconds if f else 0.0, ttft_bound=f is not None and f.bound)

    def commit(self, request_id: str, replica_id: str, now: float,
               raw_tokens: int | None = None, model_id: str | None = None) -> bool:
        return self.ledger.commit(request_id, replica_id, now, raw_tokens, model_id)

    def cancel(self, request_id: str) -> bool:
        return self.ledger.cancel(request_id) is not None

    def release(self, request_id: str, telemetry: RequestTelemetry | None = None) -> bool:
        """Refund once; learn from the telemetry of the refund that actually happened."""
        res = self.ledger.release(request_id)
        if res is None:
            return False
        self.counters["replica_releases"] += 1
        if telemetry is None:
            return True
        rep = self.ledger.replica(res.model, res.replica_id)
        chip = rep.key.chip_class if rep else "unknown"
        execution = (parse_execution(telemetry.execution_identity)
                     if telemetry.execution_identity is not None else (rep.key.execution if rep else ""))
        key = ExecutionKey(res.model, chip, execution)
        if telemetry.ttft_s is not None:
            # Solo only if the request never shared its replica AND its box was last seen quiet;
            # a request merely admitted alone may have decoded next to later arrivals.
            box = self._node_load.get(rep.node_id, {}) if rep else {}
            solo = (telemetry.batch_size <= 1 and telemetry.max_batch_size is not None
                    and telemetry.max_batch_size <= 1 and sum(box.values()) <= 1)
            self.rates.record_request(key, RequestSample(computed_prompt(telemetry), telemetry.batch_size,
                                                         telemetry.ttft_s, telemetry.tpot_s), solo)
            if res.predicted_ttft_s and (rep is None or key == rep.key):
                self.rates.record_ttft_ratio(key, res.predicted_ttft_s, telemetry.ttft_s)
        return True

    def retire(self, replica_ids) -> int:
        """Replicas the serving layer saw go away: drop their slots and reservations now."""
        known = {r.replica_id for r in self.ledger.replicas()}
        self.counters["retired_replicas"] += len(known & set(replica_ids))
        gone = self.ledger.retire(replica_ids)
        self._prune()
        return len(gone)

    def expire(self, now: float) -> int:
        gone = self.ledger.expire(now)
        self._prune()
        return len(gone)

    def _prune(self) -> None:
        """Drop caps, observations and box loads of replicas the ledger no longer knows."""
        known = {(r.model, r.replica_id) for r in self.ledger.replicas()}
        for k in [k for k in self._decisions if k not in known]:
            self._decisions.pop(k, None)
            self._observations.pop(k, None)
        for node, loads in list(self._node_load.items()):
            for rid in [rid for rid in loads if not any(r.replica_id == rid for r in self.ledger.replicas())]:
                loads.pop(rid)
            if not loads:
                del self._node_load[node]

    # ---- public feed ---------------------------------------------------------------------------

    def snapshot(self, now: float) -> dict:
        """Public capacity feed: the same headroom function routing uses, plus per-identity caps."""
        models = []
        for model in self.ledger.models():
            feed = self.ledger.feed(model, now)
            idents = {}
            for rep in self.ledger.replicas(model):
                d = self._decisions.get((model, rep.replica_id))
                row = idents.setdefault(rep.key, {
                    "identity": rep.key.execution or "native", "chip_class": rep.key.chip_class,
                    "cap": d.cap if d else 1, "cap_source": d.source if d else "none",
                    "solo_tps": d.solo_tps if d else None, "k": d.k if d else None,
                    "decode_tps": self.rates.load_median(rep.key),
                    "prefill_tps": self.rates.prefill_tps(rep.key),
                    "ttft_ratio": self.rates.ttft_ratio(rep.key), "replicas": 0})
                row["replicas"] += 1
            nodes: dict[str, int] = {}
            for rep in self.ledger.replicas(model):
                nodes[rep.node_id] = nodes.get(rep.node_id, 0) + 1
            models.append({"model_id": model, "ready": feed.ready, "replicas": feed.replicas,
                           "nodes": nodes,      # node id -> replicas there (which box to look at)
                           "routable_replicas": feed.routable, "headroom_raw_tokens": feed.raw_tokens,
                           "headroom_requests": feed.requests, "max_request_raw_tokens": feed.max_request,
                           "identities": list(idents.values())})
        return {"protocol_version": ActorInfo().protocol_version, "models": models,
                # Native slots decoding far below their memory bandwidth's expectation
                # (capacity/anomaly.py): observability only, routing never reads it.
                "anomalies": [a.__dict__ for a in self.anomalies()],
                "outstanding_raw_tokens": self.ledger.outstanding_raw(),
                # releases: every reservation settled, whoever settled it (the replica's release,
                # a router's cancel, a TTL, a retired replica); rebuilt: reservations rebuilt
                # from replica commits or reports without a hold here (an actor restart). Once
                # idle, holds + rebuilt == releases.
                "counters": {**self.counters, "releases": sum(self.ledger.outcomes.values()),
                             "rebuilt": self.ledger.rebuilt,
                             "settled": dict(self.ledger.outcomes)}}

    def caps(self) -> dict:
        return {f"{m}/{r}": d.cap for (m, r), d in self._decisions.items()}

    def anomalies(self) -> list:
        return check(self._observations.values(), self.cfg.anomaly)

    # ---- persistence (rates only: reservations are rebuilt from replica reports) ---------------

    def persist_state(self) -> dict:
        return {"version": SNAPSHOT_VERSION, "rates": self.rates.to_dict()}

    @classmethod
    def restore(cls, state: dict | None, cfg: FleetConfig | None = None) -> "Fleet":
        cfg = cfg or FleetConfig()
        if not state or state.get("version") != SNAPSHOT_VERSION:
            return cls(cfg)
        return cls(cfg, RateRegistry.from_dict(state.get("rates", {}), cfg.rates))


def computed_prompt(t: RequestTelemetry) -> int:
    """The prompt tokens a request's TTFT paid to compute: a prefix-cache hit computes only its
    tail, so its prompt/TTFT would price prefill several times too fast (the forecasts and the
    affine wait, capacity/affine_bound.py). A request that found half its prompt or more cached
    prices nothing (0: rates.prefill_tps skips it); its TTFT is mostly queueing and decode steps."""
    cached = min(t.cached_tokens, t.prompt_tokens)
    return 0 if 2 * cached >= t.prompt_tokens and cached else t.prompt_tokens - cached
