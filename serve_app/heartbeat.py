"""A replica's reports to the capacity actor, built from values: its identity (fixed at start),
its sequence-numbered heartbeat, and each request's telemetry.

The slot carries the *actual* execution identity of the loaded engine, its raw-token budget
use, its cost model and its observed rates, and the list of active request ids, so the actor
can reconcile reservations whose release was lost.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from capacity.identity import execution_identity
from capacity.pricing import CostModel
from capacity.protocol import (ACTOR_CAPABILITIES, MAX_ACTIVE_LISTED, ActiveRequest,
                               CostModelWire, HeartbeatReport, RequestTelemetry, SlotReport)


@dataclass(frozen=True)
class ReplicaIdentity:
    """Who reports, fixed for the replica's life: the key the actor learns its rates under."""

    replica_id: str
    node_id: str
    model_id: str
    chip_class: str
    execution: str | None     # wire form (kvq-v1:...:prefill=...); None for native (wire rule)
    # The bandwidth anomaly check's inputs (capacity/anomaly.py): measured once at start.
    memory_bandwidth_gbps: float | None = None
    active_params: int | None = None
    bytes_per_param: float | None = None

    @classmethod
    def of(cls, replica_id: str, node_id: str, model_id: str, format_identity: str,
           prefill_mode: str, model: Any = None) -> "ReplicaIdentity":
        """The wire execution, not the bare format identity, which the actor's grammar would
        quarantine and drop. `model`: the loaded MLX model, whose weights and this box's
        measured memory bandwidth feed the actor's anomaly check."""
        params, per_param = model_weights(model) if model is not None else (None, None)
        return cls(replica_id, node_id, model_id, chip_class(),
                   execution_identity(format_identity, prefill_mode) or None,
                   measure_memory_bandwidth_gbps() if params else None, params, per_param)


def model_weights(model: Any) -> tuple[int | None, float | None]:
    """(parameters, bytes per parameter) of a loaded MLX model, as its arrays hold them.

    Packed (quantized) weights count the values they hold, not their uint32 words, so bytes per
    parameter is the stored bits / 8 (scales included). Every parameter counts as active: for a
    mixture of experts that overstates the bytes one token reads, which lowers the expectation
    and can only hide an anomaly, never invent one."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    quant = getattr(getattr(model, "args", None), "quantization", None)
    bits = int(quant.get("bits", 4)) if isinstance(quant, dict) else 4
    params = nbytes = 0
    for _, a in tree_flatten(model.parameters()):
        nbytes += a.nbytes
        params += a.size * 32 // bits if a.dtype == mx.uint32 else a.size
    return (params, nbytes / params) if params else (None, None)


# A copy of 64 MiB reads and writes 128 MiB: past the caches (16 MiB measured 3-5x high on a
# Xeon), and ~0.1 s for the whole probe on a loaded 2-core box (256 MiB took 0.5-3.6 s there:
# on the path of a replacement replica's start-up, i.e. of recovery).
_BANDWIDTH_PROBE_BYTES = 64 << 20


@functools.cache
def measure_memory_bandwidth_gbps(repeats: int = 3) -> float | None:
    """This device's memory bandwidth in GB/s, measured once per process: the best of a few
    timed array copies (bytes read + written per second), so the expectation is this box's, not
    a spec sheet's."""
    import mlx.core as mx

    try:
        src = mx.ones((_BANDWIDTH_PROBE_BYTES // 4,), dtype=mx.float32)
        mx.eval(src)
        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(src + 0)   # one pass: read every byte once, write every byte once
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        del src
        return 2 * _BANDWIDTH_PROBE_BYTES / best / 1e9 if best else None
    except Exception:  # noqa: BLE001 - metadata only: no measurement, no anomaly check
        return None


def chip_class() -> str:
    """The chip class rate histories are keyed by (wire grammar: no spaces, at most 64 chars).

    'M3|Max' on Apple Silicon; 'cuda|NVIDIA|H200' when MLX computes on another GPU; else the
    host platform, e.g. 'linux-x86_64' (CPU). A CUDA box and a CPU box of the same platform
    must not share learned rates: their decode speeds differ by orders of magnitude.
    """
    import platform

    try:
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else {}
        name = str(info.get("device_name") or "")
        if name.startswith("Apple "):
            return name.removeprefix("Apple ").replace(" ", "|")
        if mx.default_device().type == mx.gpu:
            return _wire_chip("cuda|" + (name or "gpu"))
    except Exception:  # noqa: BLE001 - metadata only
        pass
    return f"{platform.system().lower()}-{platform.machine()}"


def _wire_chip(text: str) -> str:
    """Spaces become '|', characters outside the chip-class grammar are dropped, 64 chars."""
    text = "|".join(text.split())
    return "".join(c for c in text if c.isascii() and (c.isalnum() or c in "._|+-"))[:64]


def slot_report(ident: ReplicaIdentity, stats: Any, cost: CostModel, active: dict[str, int],
                state: str | None = None, warmup_solo_tps=()) -> SlotReport:
    """`stats`: the engine's EngineStats now; `active`: request id -> raw tokens being served;
    `warmup_solo_tps`: the warm-up's lone decode steps (engine/warmup.py), solo samples."""
    running = stats.num_requests_running
    waiting = stats.num_requests_waiting
    step_s = stats.decode_step_s
    return SlotReport(
        model_id=ident.model_id,
        state=state or ("running" if running + waiting or active else "idle"),
        declared_execution=ident.execution,
        execution_identity=ident.execution,
        num_running=running,
        num_waiting=waiting,
        raw_budget_used=sum(active.values()),
        max_concurrency=cost.concurrency_ceiling,
        kv_bytes_per_token=cost.bytes_per_token,
        used_bytes=stats.kv_bytes_reserved,
        cost_model=CostModelWire.from_cost_model(cost),
        # Each running request gets one token per decode step: per-request tok/s under load.
        observed_decode_tps=(1.0 / step_s) if step_s and running else None,
        observed_prefill_tps=stats.prefill_tokens_per_s or None,
        decode_step_profile=sorted(stats.decode_step_profile.items())[:64],
        warmup_solo_tps=list(warmup_solo_tps)[:64],
        active=[ActiveRequest(request_id=rid, raw_tokens=raw)
                for rid, raw in list(active.items())[:MAX_ACTIVE_LISTED]],
        active_complete=len(active) <= MAX_ACTIVE_LISTED,
        active_params=ident.active_params,
        bytes_per_param=ident.bytes_per_param,
    )


def build_report(ident: ReplicaIdentity, stats: Any, cost: CostModel, active: dict[str, int],
                 incarnation: int, seq: int, state: str | None = None,
                 warmup_solo_tps=()) -> HeartbeatReport:
    return HeartbeatReport(replica_id=ident.replica_id, node_id=ident.node_id,
                           chip_class=ident.chip_class, incarnation=incarnation, seq=seq,
                           capabilities=sorted(ACTOR_CAPABILITIES),
                           memory_bandwidth_gbps=ident.memory_bandwidth_gbps,
                           slots=[slot_report(ident, stats, cost, active, state,
                                              warmup_solo_tps)])


@dataclass
class RequestMeter:
    """One request's batch and timing facts as its deltas pass; its telemetry at the end."""

    prompt_tokens: int            # the prompt's length, until the engine reports usage
    running_at_admission: int     # engine requests running when this one arrived
    started: float = field(default_factory=time.monotonic)
    last_t: float | None = None   # when the last delta came
    ttft_s: float | None = None
    usage: Any = None             # the engine's latest TokenUsage
    finish: str | None = None
    deltas: int = 0

    def saw(self, delta: Any) -> bool:
        """Record an engine delta; True for the first."""
        self.deltas += 1
        self.last_t = time.monotonic()
        if delta.ttft_s is not None:
            self.ttft_s = delta.ttft_s
        self.usage, self.finish = delta.usage, delta.finish_reason
        return self.deltas == 1

    def telemetry(self, running_at_end: int, execution: str | None) -> RequestTelemetry:
        u = self.usage
        completion = u.completion_tokens if u else 0
        last_t = self.started if self.last_t is None else self.last_t
        tpot = ((last_t - self.started - (self.ttft_s or 0)) / (completion - 1)
                if completion > 1 else None)
        return RequestTelemetry(
            prompt_tokens=u.prompt_tokens if u else self.prompt_tokens,
            completion_tokens=completion, cached_tokens=getattr(u, "cached_tokens", 0) or 0,
            batch_size=max(1, self.running_at_admission + 1),
            # Seen at admission and at finish: a request is a solo sample only if both are 1
            # (the actor takes solo decode rates only from such requests).
            max_batch_size=max(1, max(self.running_at_admission, running_at_end) + 1),
            ttft_s=self.ttft_s or None, tpot_s=tpot or None,
            execution_identity=execution, finish_reason=self.finish or "cancelled")
