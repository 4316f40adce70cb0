"""Summaries and tables from raw request records (exact values, not Locust's rounded buckets)."""
from __future__ import annotations

import json
from collections import Counter

from loadtest.records import RequestRecord

DELIVERY_GOAL_P99_MS = 5.0
DELIVERY_GOAL_MAX_RATE = 20.0   # req/s up to which the delivery goal applies


def delivery_failure(summary: dict) -> str | None:
    """Why the run misses the mixed-arrival methodology's delivery goal (p99 delivery error
    <= DELIVERY_GOAL_P99_MS while the offered rate is within DELIVERY_GOAL_MAX_RATE), or None
    when it meets it or the goal does not apply. `--require-delivery` turns this into the exit
    status; without it the figure is reported only."""
    d = summary["delivery_error_ms"]
    if not d.get("goal_applies"):
        return None
    goal = d.get("goal_p99_ms", DELIVERY_GOAL_P99_MS)
    rate = summary.get("schedule", {}).get("mean_rate")
    where = f"at a mean {rate:.1f} req/s" if rate is not None else "at the offered rate"
    if d.get("p99") is None:
        return f"delivery goal not shown: no request was sent (goal p99 <= {goal:g} ms {where})"
    if d["p99"] > goal:
        return (f"delivery goal missed: p99 delivery error {d['p99']:.2f} ms > {goal:g} ms "
                f"goal {where} (<= {DELIVERY_GOAL_MAX_RATE:g} req/s, where the goal applies); "
                f"the load generator sent late, so latencies include its lateness "
                f"(try --spin-ms, --sched, or a quieter host)")
    return None


def pct(values, q: float) -> float | None:
    """Percentile q in [0, 100] with linear interpolation (numpy's default)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(values) -> dict:
    xs = [v for v in values if v is not None]
    out = {"n": len(xs), "mean": (sum(xs) / len(xs)) if xs else None}
    for q in (50, 95, 99):
        out[f"p{q}"] = pct(xs, q)
    out["max"] = max(xs) if xs else None
    return out


def load_records(path: str) -> tuple[list[RequestRecord], dict]:
    with open(path) as f:
        obj = json.load(f)
    return [RequestRecord.from_dict(d) for d in obj["records"]], obj.get("meta", {})


def _error_key(r: RequestRecord) -> str:
    if r.hung:
        return "hung"
    if r.status is None:
        return "connection"
    if r.status == 200:
        return "stream"
    return str(r.status)


def summarize(records: list[RequestRecord], meta: dict, slo_ttft_ms: float,
              slo_tpot_ms: float) -> dict:
    ok = [r for r in records if r.outcome == "ok"]
    refused = [r for r in records if r.outcome == "refused"]
    sent = [r for r in records if r.sent is not None]
    outcomes = Counter(r.outcome for r in records)
    ends = [r.sent + r.done for r in sent if r.done is not None]
    wall = (max(ends) - min(r.sent for r in sent)) if ends else 0.0
    tokens = sum(r.output_tokens or 0 for r in ok)
    good = [r for r in ok if r.ttft_ms is not None and r.ttft_ms <= slo_ttft_ms
            and (r.tpot_ms is None or r.tpot_ms <= slo_tpot_ms)]
    errors = [r for r in records if r.outcome in ("error", "hung")]
    delivery = dist(r.delivery_error_ms for r in sent)
    peak = meta.get("peak_rate_1s")
    span = max((r.scheduled for r in records), default=0.0)
    mean_rate = len(records) / span if span > 0 else None
    per_s = (lambda n: n / wall if wall > 0 else None)
    return {
        "scenario": meta.get("scenario"),
        "target": {"host": meta.get("host"), "slice": meta.get("slice")},
        "schedule": {"requests": len(records), "duration_s": max((r.scheduled for r in records),
                                                                  default=0.0),
                     "mean_rate": mean_rate, "peak_rate_1s": peak,
                     "scaled_mix": meta.get("scaled_mix")},
        "counts": {"scheduled": len(records), "sent": len(sent), **{k: outcomes.get(k, 0) for k in
                   ("ok", "refused", "error", "hung", "unsent")}},
        "errors_by_status": dict(Counter(_error_key(r) for r in errors)),
        "refusals_by_status": dict(Counter(str(r.status) for r in refused)),
        "refusals_without_retry_after": sum(1 for r in refused if not r.retry_after),
        "retried_after_refusal": {"requests": sum(1 for r in records if r.refused_attempts),
                                  "attempts": sum(r.refused_attempts for r in records),
                                  "then_served": sum(1 for r in ok if r.refused_attempts)},
        "error_examples": sorted({(r.error or "")[:160] for r in errors})[:5],
        "throughput": {"wall_s": wall, "requests_per_s": per_s(len(ok)),
                       "output_tokens_per_s": per_s(tokens), "output_tokens": tokens},
        "goodput": {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
                    "requests_per_s": per_s(len(good)),
                    "fraction_of_ok": (len(good) / len(ok)) if ok else None},
        "metrics": {
            "ttft_ms": dist(r.ttft_ms for r in ok),
            "itl_ms": dist(g for r in ok for g in r.itl_ms),
            "tpot_ms": dist(r.tpot_ms for r in ok),
            "e2e_ms": dist(r.e2e_ms for r in ok),
            "output_tokens": dist(r.output_tokens for r in ok),
        },
        "ttft_recorded_for_every_ok": all(r.ttft_ms is not None for r in ok),
        "usage_missing": sum(1 for r in ok if r.usage_missing),
        "delivery_error_ms": {**delivery, "goal_p99_ms": DELIVERY_GOAL_P99_MS,
                              "sched": meta.get("sched"), "spin_ms": meta.get("spin_ms"),
                              # the goal is stated for offered (mean) rates up to 20 req/s
                              "goal_applies": mean_rate is not None
                              and mean_rate <= DELIVERY_GOAL_MAX_RATE,
                              "goal_met": delivery["p99"] is not None
                              and delivery["p99"] <= DELIVERY_GOAL_P99_MS},
        "by_pattern": {p: {"n": len(rs), "ok": sum(r.outcome == "ok" for r in rs),
                           "ttft_ms_p50": pct([r.ttft_ms for r in rs if r.outcome == "ok"], 50),
                           "ttft_ms_p99": pct([r.ttft_ms for r in rs if r.outcome == "ok"], 99),
                           "delivery_ms_p99": pct([r.delivery_error_ms for r in rs], 99)}
                       for p, rs in _group(records, lambda r: r.pattern).items()},
        "overload_rules": overload_rules(records),
    }


def pool(runs: list[tuple[dict, list[RequestRecord]]], meta: dict, slo_ttft_ms: float,
         slo_tpot_ms: float) -> dict:
    """One summary over repeated runs of a target: latency percentiles over all requests;
    throughput and goodput as totals over the summed wall time (each run has its own clock)."""
    records = [r for _, recs in runs for r in recs]
    out = summarize(records, meta, slo_ttft_ms, slo_tpot_ms)
    wall = sum(s["throughput"]["wall_s"] for s, _ in runs)
    ok = [r for r in records if r.outcome == "ok"]
    good = sum((s["goodput"]["requests_per_s"] or 0) * s["throughput"]["wall_s"] for s, _ in runs)
    tokens = sum(r.output_tokens or 0 for r in ok)
    out["throughput"] = {"wall_s": wall, "requests_per_s": len(ok) / wall if wall else None,
                         "output_tokens_per_s": tokens / wall if wall else None,
                         "output_tokens": tokens}
    out["goodput"]["requests_per_s"] = good / wall if wall else None
    first = runs[0][0]
    out["target"] = first["target"]
    # Every run replays the same schedule: its rate is one run's, not the pooled count over
    # one run's span (which would multiply it by the repeats and lift the delivery goal).
    out["schedule"] = first["schedule"]
    out["delivery_error_ms"]["goal_applies"] = all(
        s["delivery_error_ms"]["goal_applies"] for s, _ in runs)
    idles = [s["capacity_after"].get("idle") for s, _ in runs]
    out["capacity_after"] = {"checked": any(s["capacity_after"].get("checked") for s, _ in runs),
                             "idle": False if False in idles else (True if True in idles else None)}
    out["host"] = {"runs": [s.get("host") for s, _ in runs],
                   "loadavg_1m_before": first.get("host", {}).get("loadavg_1m_before"),
                   "loadavg_1m_after": runs[-1][0].get("host", {}).get("loadavg_1m_after")}
    out["repeats"] = len(runs)
    out["per_run_output_tokens_per_s"] = [s["throughput"]["output_tokens_per_s"] for s, _ in runs]
    out["files"] = {"runs": [s["files"] for s, _ in runs]}
    return out


def _group(items, key):
    out: dict = {}
    for it in items:
        out.setdefault(key(it), []).append(it)
    return out


def overload_rules(records: list[RequestRecord]) -> dict:
    """Every request served or cleanly refused: 429/503 with Retry-After, no other failures."""
    refused = [r for r in records if r.outcome == "refused"]
    other = [r for r in records if r.outcome not in ("ok", "refused")]
    five_xx = [r for r in other if r.status is not None and r.status >= 500]
    checks = {
        "all_served_or_refused": not other,
        "refusals_carry_retry_after": all(r.retry_after for r in refused),
        "zero_other_5xx": not five_xx,
        "zero_hung_streams": not any(r.hung for r in records),
    }
    return {**checks, "passed": all(checks.values())}


def _fmt(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown_row_table(summaries: dict[str, dict]) -> str:
    """One row per target: the headline numbers."""
    head = ("| target | ok/sent | refused | errors | tokens/req | out tok/s | goodput req/s | "
            "TTFT p50 ms | "
            "TTFT p99 ms | TPOT p50 ms | ITL p99 ms | E2E p99 ms | delivery p50/p99 ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, s in summaries.items():
        c, m, d = s["counts"], s["metrics"], s["delivery_error_ms"]
        lines.append(
            f"| {label} | {c['ok']}/{c['sent']} | {c['refused']} | {c['error'] + c['hung']} | "
            f"{_fmt(m['output_tokens']['p50'], 0)} | {_fmt(s['throughput']['output_tokens_per_s'])} | "
            f"{_fmt(s['goodput']['requests_per_s'], 2)} | {_fmt(m['ttft_ms']['p50'])} | "
            f"{_fmt(m['ttft_ms']['p99'])} | {_fmt(m['tpot_ms']['p50'])} | "
            f"{_fmt(m['itl_ms']['p99'])} | {_fmt(m['e2e_ms']['p99'])} | "
            f"{_fmt(d['p50'], 2)}/{_fmt(d['p99'], 2)} |")
    return "\n".join(lines)


def ratio_table(summaries: dict[str, dict], baseline: str) -> str:
    """Each target against the baseline: >1 is better for tok/s and goodput, <1 for latency."""
    base = summaries[baseline]
    rows = [("served requests", ("counts", "ok")),
            ("output tok/s", ("throughput", "output_tokens_per_s")),
            ("goodput req/s", ("goodput", "requests_per_s")),
            ("TTFT p50", ("metrics", "ttft_ms", "p50")), ("TTFT p99", ("metrics", "ttft_ms", "p99")),
            ("TPOT p50", ("metrics", "tpot_ms", "p50")), ("E2E p99", ("metrics", "e2e_ms", "p99"))]
    others = [k for k in summaries if k != baseline]
    lines = [f"| ratio vs {baseline} | " + " | ".join(others) + " |",
             "|---|" + "---|" * len(others)]
    for name, keys in rows:
        cells = []
        for k in others:
            a, b = _get(summaries[k], keys), _get(base, keys)
            cells.append("-" if a is None or not b else f"{a / b:.2f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _get(d, keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def pattern_table(summaries: dict[str, dict]) -> str:
    """TTFT p50/p99 (ms) per arrival pattern and target: how each server takes bursts."""
    labels = list(summaries)
    patterns = sorted({p for s in summaries.values() for p in s["by_pattern"]})
    lines = ["| pattern | " + " | ".join(f"{k} TTFT p50/p99 ms" for k in labels) + " |",
             "|---|" + "---|" * len(labels)]
    for p in patterns:
        cells = []
        for k in labels:
            row = summaries[k]["by_pattern"].get(p, {})
            cells.append(f"{_fmt(row.get('ttft_ms_p50'), 0)}/{_fmt(row.get('ttft_ms_p99'), 0)}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
