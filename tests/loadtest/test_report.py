"""Request metrics and the summary built from them."""
from __future__ import annotations

import pytest

from loadtest import report
from loadtest.records import RequestRecord


def rec(i, **kw):
    base = dict(index=i, pattern="poisson", prompt_tokens_target=100, max_tokens=4,
                scheduled=float(i))
    base.update(kw)
    return RequestRecord(**base)


def served(i, ttft=0.1, gap=0.02, n=4, late=0.001):
    times = [ttft + k * gap for k in range(n)]
    return rec(i, sent=i + late, status=200, chunk_times=times, done=times[-1] + 0.005,
               output_tokens=n, prompt_tokens=100, finish_reason="length")


def test_request_metrics():
    r = served(0, ttft=0.1, gap=0.02, n=4, late=0.003)
    assert r.outcome == "ok"
    assert r.ttft_ms == pytest.approx(100.0)
    assert r.itl_ms == pytest.approx([20.0, 20.0, 20.0])
    assert r.e2e_ms == pytest.approx(165.0)
    assert r.tpot_ms == pytest.approx((165.0 - 100.0) / 3)
    assert r.delivery_error_ms == pytest.approx(3.0)
    assert RequestRecord.from_dict(r.to_dict()) == r


def test_outcomes():
    assert rec(0).outcome == "unsent"
    assert rec(0, sent=0.0).outcome == "in-flight"
    assert rec(0, sent=0.0, status=429, retry_after="1", done=0.01).outcome == "refused"
    assert rec(0, sent=0.0, status=500, error="HTTP 500", done=0.01).outcome == "error"
    assert rec(0, sent=0.0, hung=True).outcome == "hung"
    assert rec(0, sent=0.0, status=200, chunk_times=[0.1], done=0.2,
               error="stream ended without [DONE]").outcome == "error"


def test_summary_counts_slos_and_delivery():
    recs = [served(i, ttft=0.1 * (i + 1)) for i in range(10)]
    recs.append(rec(10, sent=10.0, status=503, retry_after="2", done=0.01, error="HTTP 503"))
    s = report.summarize(recs, {"peak_rate_1s": 1.0, "scenario": "t"}, slo_ttft_ms=500.0,
                         slo_tpot_ms=100.0)
    assert s["counts"]["ok"] == 10 and s["counts"]["refused"] == 1
    assert s["refusals_by_status"] == {"503": 1} and s["errors_by_status"] == {}
    assert s["goodput"]["fraction_of_ok"] == pytest.approx(0.5)  # TTFT 100..500 ms meet it
    assert s["metrics"]["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert s["metrics"]["output_tokens"]["p50"] == 4
    assert s["delivery_error_ms"]["p99"] == pytest.approx(1.0)
    assert s["delivery_error_ms"]["goal_met"] and s["delivery_error_ms"]["goal_applies"]
    assert s["schedule"]["mean_rate"] == pytest.approx(11 / 10)
    assert s["ttft_recorded_for_every_ok"]
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(40 / s["throughput"]["wall_s"])
    assert s["overload_rules"]["passed"]


@pytest.mark.parametrize("bad,rule", [
    (dict(status=429, retry_after=None, done=0.01, error="HTTP 429"),
     "refusals_carry_retry_after"),
    (dict(status=500, done=0.01, error="HTTP 500"), "zero_other_5xx"),
    (dict(hung=True), "zero_hung_streams"),
    (dict(status=None, error="ConnectionRefusedError"), "all_served_or_refused"),
])
def test_overload_rules_catch_each_violation(bad, rule):
    recs = [served(0), rec(1, sent=1.0, **bad)]
    rules = report.overload_rules(recs)
    assert not rules[rule] and not rules["passed"]


def test_percentile_interpolates_like_numpy():
    assert report.pct([1, 2, 3, 4], 50) == 2.5
    assert report.pct([5], 99) == 5
    assert report.pct([], 50) is None


def test_tables_render():
    s = report.summarize([served(0), served(1)], {"peak_rate_1s": 1.0}, 500.0, 100.0)
    t = report.markdown_row_table({"a": s, "b": s})
    assert t.count("\n") == 3 and "| a |" in t
    r = report.ratio_table({"a": s, "b": s}, "b")
    assert "| output tok/s | 1.00x |" in r
    pt = report.pattern_table({"a": s})
    assert "| poisson | 100/100 |" in pt


def test_retry_keeps_first_send_time():
    from loadtest.stream import retry_delay

    r = rec(0, sent=0.5, status=429, retry_after="2", done=0.01, error="HTTP 429")
    assert r.outcome == "refused"
    r.reset_for_retry()
    assert r.sent == 0.5 and r.status is None and r.refused_attempts == 1
    assert retry_delay("2") == 2.0 and retry_delay(None) == 1.0
    assert retry_delay("Wed, 21 Oct 2015 07:28:00 GMT") == 1.0 and retry_delay("999") == 30.0


def test_wall_time_includes_streams_cut_as_hung():
    recs = [served(0), rec(1, sent=1.0, status=200, chunk_times=[0.2], done=30.0, hung=True)]
    s = report.summarize(recs, {"peak_rate_1s": 1.0}, 500.0, 100.0)
    assert s["throughput"]["wall_s"] == pytest.approx(31.0 - 0.001)
    assert s["counts"]["hung"] == 1 and s["metrics"]["e2e_ms"]["n"] == 1


def test_pool_sums_throughput_over_runs():
    run_a = [served(0), served(1)]
    run_b = [served(0, ttft=0.3), served(1, ttft=0.3), rec(2, sent=2.0, status=429,
                                                            retry_after="1", done=0.01)]
    sa = report.summarize(run_a, {"peak_rate_1s": 1.0}, 500.0, 100.0)
    sb = report.summarize(run_b, {"peak_rate_1s": 1.0}, 500.0, 100.0)
    for s in (sa, sb):
        s["capacity_after"] = {"checked": True, "idle": True}
        s["files"] = {}
    p = report.pool([(sa, run_a), (sb, run_b)], {"peak_rate_1s": 1.0}, 500.0, 100.0)
    wall = sa["throughput"]["wall_s"] + sb["throughput"]["wall_s"]
    assert p["throughput"]["output_tokens_per_s"] == pytest.approx(16 / wall)
    assert p["counts"]["ok"] == 4 and p["counts"]["refused"] == 1 and p["repeats"] == 2
    assert p["metrics"]["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert p["capacity_after"]["idle"] is True
