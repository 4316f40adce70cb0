"""Build a replica's sequence-numbered heartbeat from its engine's live state.

The slot carries the *actual* execution identity of the loaded engine, its raw-token budget
use, its cost model and its observed rates, and the list of active request ids, so the actor
can reconcile reservations whose release was lost.
"""
from __future__ import annotations

from typing import Any

from capacity.identity import execution_identity
from capacity.protocol import (ACTOR_CAPABILITIES, MAX_ACTIVE_LISTED, ActiveRequest,
                               CostModelWire, HeartbeatReport, SlotReport)


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


def slot_report(server: Any, state: str | None = None) -> SlotReport:
    eng = server.engine
    stats = eng.stats()
    cost = eng.cost_model()
    running = stats.num_requests_running
    waiting = stats.num_requests_waiting
    execution = execution_identity(eng.format_identity, stats.prefill_mode)
    active = server.active_raw_tokens()
    step_s = stats.decode_step_s
    return SlotReport(
        model_id=server.model_id,
        state=state or ("running" if running + waiting or active else "idle"),
        declared_execution=execution or None,   # native omits it (wire rule)
        execution_identity=execution or None,
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
        active=[ActiveRequest(request_id=rid, raw_tokens=raw)
                for rid, raw in list(active.items())[:MAX_ACTIVE_LISTED]],
        active_complete=len(active) <= MAX_ACTIVE_LISTED,
    )


def build_report(server: Any, incarnation: int, seq: int, state: str | None = None
                 ) -> HeartbeatReport:
    return HeartbeatReport(replica_id=server.replica_id, node_id=server.node_id,
                           chip_class=chip_class(), incarnation=incarnation, seq=seq,
                           capabilities=sorted(ACTOR_CAPABILITIES),
                           slots=[slot_report(server, state)])
