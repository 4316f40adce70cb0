"""The engine's stats() snapshot: vLLM-style names plus format, prefix-cache and path counters.

Built on the engine thread after every step; callers read the last snapshot without locking.
"""
from __future__ import annotations

from collections import Counter

from engine.attention.packed_store import counters_of

# Counters always present in stats() (zero until they happen), so dashboards see every series.
COUNTED = ("submitted", "admitted", "refused_too_large", "refused_deadline", "refused_overloaded",
           "refused_invalid", "refused_shutdown", "finished_stop", "finished_length",
           "finished_cancelled", "finished_deadline", "finished_error")
PATH_COUNTERS = ("direct", "fused", "budget_fallback", "ineligible_fallback")


def collect_stats(eng) -> dict:
    sch, pool, ledger = eng.scheduler, eng.scheduler.pool, eng.scheduler.ledger
    page_bytes = eng.kvstore.page_bytes
    stats = {
        "model_id": eng.model_id, "format_identity": eng.format_identity,
        "kv_format": eng.kv_format, "prefill_mode": eng.cfg.prefill_mode,
        "storage_identity": eng.storage_identity, "kv_layers": eng._layer_report,
        "kv_path_counters": {**dict.fromkeys(PATH_COUNTERS, 0), **counters_of(eng.kvstore)},
        "kv_workspace_bytes": ledger.workspace_bytes,
        "kv_raw_tokens_reserved": ledger.raw_tokens_reserved,
        "prefix_cache_enabled": sch.prefix is not None,
        "prefix_cache_pages": len(sch.prefix) if sch.prefix is not None else 0,
        "prefix_cache_bytes": ledger.cache_bytes,
        "prefix_cache_evictable_pages": sch.evictable_pages,
        "tenant": eng.cfg.tenant,
        "num_requests_running": len(sch.running),
        "num_requests_waiting": len(sch.waiting),
        "kv_cache_usage_perc": pool.num_used / pool.num_pages,
        "kv_pages_used": pool.num_used, "kv_pages_total": pool.num_pages,
        "kv_bytes_used": pool.num_used * page_bytes,
        # What admission cannot use: cached pages no request holds are evicted on demand,
        # so routing headroom (computed from this) does not count them.
        "kv_bytes_reserved": ledger.used_bytes - sch.evictable_pages * ledger.page_charge,
        "kv_bytes_total": ledger.budget_bytes,
        "page_tokens": pool.page_tokens, "retired_step": eng._retired_step,
        "prefill_tokens_per_s": sch.forecast.prefill_tps,
        "decode_step_s": sch.forecast.decode_step_s,
        "decode_step_profile": dict(sch.forecast.decode_profile),
        "prompt_tokens_total": eng._counters["prompt_tokens"],
        "generation_tokens_total": eng._counters["generation_tokens"],
        "steps_total": eng._counters["steps"],
    }
    counts = Counter({k: 0 for k in COUNTED})
    counts.update({k: v for k, v in eng._counters.items() if k.startswith("refused_")})
    counts.update({k: v for k, v in sch.counters.items() if not k.startswith("prefix_")})
    stats.update({f"{k}_total": sch.counters[k]
                  for k in ("prefix_hits", "prefix_hit_tokens", "prefix_evicted_pages")})
    stats.update({f"requests_{k}_total": counts[k] for k in sorted({*COUNTED, *counts})})
    return stats

