"""The chat scenario's report: per target, TTFT of first and later turns, how much of the
history the server said it had cached, throughput over the target's own span, and which later
turns moved to another replica; for two targets, the first's metrics over the second's.

Built from legs (loadtest/chat_legs.py): each leg is one Locust run of the plan against one or
more targets, with its own records, router counters, replica-load samples and load average."""
from __future__ import annotations

import statistics

RATIO_KEYS = ("ttft_p50_turns2plus_ms", "ttft_mean_turns2plus_ms", "ttft_p50_turn1_ms",
              "output_tokens_per_s", "cached_share_of_history", "e2e_p50_ms")
# What a leg carries besides its per-target data: copied into summary["legs"].
LEG_FACTS = ("labels", "locust_exit_code", "wall_s", "started_utc", "loadavg_1m_before",
             "loadavg_1m_after")


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def switched(ok: list[dict]) -> dict:
    """Later turns served by another replica than their conversation's previous turn: a
    capacity-only router must move some conversations for routing, not cache size, to be what
    the two targets differ in; `missed_half` counts turns with under half their history cached."""
    where = {(r["conversation"], r["turn"]): r.get("replica") for r in ok}
    pairs = [(where.get((r["conversation"], r["turn"] - 1)), r.get("replica"))
             for r in ok if r["turn"] >= 2]
    known = [(a, b) for a, b in pairs if a and b]
    return {"turns_with_replicas": len(known), "switched": sum(a != b for a, b in known),
            "switched_share": sum(a != b for a, b in known) / len(known) if known else None,
            "missed_half": sum((r["cached_tokens"] or 0) < 0.5 * (r["history_tokens"] or 0)
                               for r in ok if r["turn"] >= 2)}


def summarize(rows: list[dict], label: str) -> dict:
    mine = [r for r in rows if r["target"] == label]
    ok = [r for r in mine if r["status"] == 200 and r["error"] is None and r["chunk_times"]]
    later = [r for r in ok if r["turn"] >= 2]
    history = sum(r["history_tokens"] or 0 for r in later)
    cached = sum(r["cached_tokens"] or 0 for r in later)
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    # Each target's own span (first send to last end): targets run at once but finish apart.
    span = (max(r["sent"] + r["done"] for r in ok) - min(r["sent"] for r in ok)) if ok else 0.0
    return {
        "turns": len(mine), "ok": len(ok), "failed": len(mine) - len(ok),
        "conversations": len({r["conversation"] for r in mine}),
        "ttft_p50_turn1_ms": p50([r["chunk_times"][0] * 1000 for r in ok if r["turn"] == 1]),
        "ttft_p50_turns2plus_ms": p50([r["chunk_times"][0] * 1000 for r in later]),
        "prompt_tokens_turns2plus": sum(r["prompt_tokens"] or 0 for r in later),
        "history_tokens_turns2plus": history,
        "cached_tokens_turns2plus": cached,
        "cached_share_of_history": cached / history if history else None,
        "output_tokens": out_tokens,
        "span_s": span,
        "output_tokens_per_s": out_tokens / span if span else None,
        "e2e_p50_ms": p50([r["done"] * 1000 for r in ok]),
        "ttft_mean_turns2plus_ms": (statistics.fmean(r["chunk_times"][0] * 1000 for r in later)
                                    if later else None),
        "later_turns": switched(ok),
    }


def ratios(a: dict, b: dict) -> dict:
    return {k: (a[k] / b[k] if a[k] is not None and b[k] else None) for k in RATIO_KEYS}


def build(params: dict, mode: str, legs: list[dict], cpus: int | None,
          plan_sha256: str | None = None) -> dict:
    """summary.json: the run's parameters and mode, each leg's facts in the order run, and per
    target its metrics, router counter deltas and replica load (from the leg that played it)."""
    codes = [leg["locust_exit_code"] for leg in legs]
    summary = {"params": params, "mode": mode, "plan_sha256": plan_sha256,
               "order": [list(leg["labels"]) for leg in legs],
               "locust_exit_code": next((c for c in codes if c), 0),
               "wall_s": sum(leg["wall_s"] for leg in legs),
               "host": {"cpus": cpus,
                        "loadavg_1m_before": legs[0]["loadavg_1m_before"] if legs else None,
                        "loadavg_1m_after": legs[-1]["loadavg_1m_after"] if legs else None},
               "legs": [{k: leg.get(k) for k in LEG_FACTS} for leg in legs],
               "targets": {}}
    for leg in legs:
        for label in leg["labels"]:
            s = summarize(leg["records"], label)
            s["router_events"] = leg["router_events"][label]
            s["replica_load"] = leg["replica_load"][label]
            summary["targets"][label] = s
    if len(summary["targets"]) == 2:
        a, b = summary["targets"].values()
        summary["ratios_first_over_second"] = ratios(a, b)
    return summary
