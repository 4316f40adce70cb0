"""The engine's stats() snapshot: vLLM-style names plus format, prefix-cache and path counters.

Built on the engine thread after every step; callers read the last snapshot without locking.
It is a frozen `EngineStats`; `as_dict()` gives the flat JSON form (one key per field, request
outcomes as `requests_<name>_total`) for the boundaries that need a dict.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

from engine.attention.layers import counters_of

# Counters always present in stats() (zero until they happen), so dashboards see every series.
COUNTED = ("submitted", "admitted", "refused_too_large", "refused_deadline", "refused_overloaded",
           "refused_invalid", "refused_shutdown", "finished_stop", "finished_length",
           "finished_cancelled", "finished_deadline", "finished_error")
PATH_COUNTERS = ("direct", "fused", "budget_fallback", "ineligible_fallback")


@dataclass(frozen=True)
class EngineStats:
    model_id: str
    format_identity: str
    kv_format: str
    prefill_mode: str
    storage_identity: str
    kv_layers: list              # per paged layer: {"layer", "storage", "bytes_per_token"}
    kv_path_counters: dict       # packed attention paths taken (PATH_COUNTERS and more)
    kv_workspace_bytes: int
    kv_raw_tokens_reserved: int
    prefix_cache_enabled: bool
    prefix_cache_pages: int
    prefix_cache_bytes: int
    prefix_cache_evictable_pages: int
    tenant: str
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    kv_pages_used: int
    kv_pages_total: int
    kv_bytes_used: int
    # What admission cannot use: cached pages no request holds are evicted on demand, so
    # routing headroom (computed from this) does not count them.
    kv_bytes_reserved: int
    kv_bytes_total: int
    page_tokens: int
    retired_step: int
    prefill_tokens_per_s: float | None
    decode_step_s: float | None
    decode_step_profile: dict    # batch size -> median seconds per pure decode step
    prompt_tokens_total: int
    generation_tokens_total: int
    steps_total: int
    prefix_hits_total: int
    prefix_hit_tokens_total: int
    prefix_evicted_pages_total: int
    # Request outcomes by name ("submitted", "admitted", "refused_<reason>",
    # "finished_<reason>"): every name in COUNTED is present.
    requests: dict
    engine_alive: bool = True

    def as_dict(self) -> dict:
        """The flat JSON form (what stats() returned as a dict before it was typed)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "requests"}
        out.update(kv_layers=[dict(r) for r in self.kv_layers],
                   kv_path_counters=dict(self.kv_path_counters),
                   decode_step_profile=dict(self.decode_step_profile))
        out.update({f"requests_{k}_total": v for k, v in sorted(self.requests.items())})
        return out


def collect_stats(*, model_id: str, format_identity: str, kv_format: str, prefill_mode: str,
                  storage_identity: str, layer_report: list, tenant: str, kvstore, scheduler,
                  retired_step: int, counters: Counter) -> EngineStats:
    sch, pool, ledger = scheduler, scheduler.pool, scheduler.ledger
    counts = Counter({k: 0 for k in COUNTED})
    counts.update({k: v for k, v in counters.items() if k.startswith("refused_")})
    counts.update({k: v for k, v in sch.counters.items() if not k.startswith("prefix_")})
    return EngineStats(
        model_id=model_id, format_identity=format_identity, kv_format=kv_format,
        prefill_mode=prefill_mode, storage_identity=storage_identity, kv_layers=layer_report,
        kv_path_counters={**dict.fromkeys(PATH_COUNTERS, 0), **counters_of(kvstore)},
        kv_workspace_bytes=ledger.workspace_bytes,
        kv_raw_tokens_reserved=ledger.raw_tokens_reserved,
        prefix_cache_enabled=sch.prefix is not None,
        prefix_cache_pages=len(sch.prefix) if sch.prefix is not None else 0,
        prefix_cache_bytes=ledger.cache_bytes,
        prefix_cache_evictable_pages=sch.evictable_pages,
        tenant=tenant,
        num_requests_running=len(sch.running),
        num_requests_waiting=len(sch.waiting),
        kv_cache_usage_perc=pool.num_used / pool.num_pages,
        kv_pages_used=pool.num_used, kv_pages_total=pool.num_pages,
        kv_bytes_used=pool.num_used * kvstore.page_bytes,
        kv_bytes_reserved=ledger.used_bytes - sch.evictable_pages * ledger.page_charge,
        kv_bytes_total=ledger.budget_bytes,
        page_tokens=pool.page_tokens, retired_step=retired_step,
        prefill_tokens_per_s=sch.forecast.prefill_tps,
        decode_step_s=sch.forecast.decode_step_s,
        decode_step_profile=dict(sch.forecast.decode_profile),
        prompt_tokens_total=counters["prompt_tokens"],
        generation_tokens_total=counters["generation_tokens"],
        steps_total=counters["steps"],
        prefix_hits_total=sch.counters["prefix_hits"],
        prefix_hit_tokens_total=sch.counters["prefix_hit_tokens"],
        prefix_evicted_pages_total=sch.counters["prefix_evicted_pages"],
        requests=dict(sorted(counts.items())))
