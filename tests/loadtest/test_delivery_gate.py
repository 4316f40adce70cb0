"""`--require-delivery`: the mixed-arrival methodology's 5 ms delivery goal enforced, not only
reported. Driven with recorded delivery errors (records whose send lags their schedule by a
stated amount): no timing, no server."""
from __future__ import annotations

import pytest

from loadtest import bench_serve, report, runner
from loadtest.records import RequestRecord


def sent_late(i: int, late_ms: float, every_s: float = 1.0) -> RequestRecord:
    """A request scheduled at i * every_s, sent late_ms after it, served."""
    t = i * every_s
    return RequestRecord(index=i, pattern="poisson", prompt_tokens_target=100, max_tokens=4,
                         scheduled=t, sent=t + late_ms / 1000.0, status=200,
                         chunk_times=[0.1, 0.12], done=0.13, output_tokens=2)


def summary(lates_ms: list[float], every_s: float = 1.0) -> dict:
    recs = [sent_late(i, late, every_s) for i, late in enumerate(lates_ms)]
    s = report.summarize(recs, {"scenario": "poisson"}, slo_ttft_ms=2000, slo_tpot_ms=200)
    s["capacity_after"] = {"checked": True, "idle": True}
    s["target"]["label"] = "orchard"
    return s


LATE = [1.0] * 90 + [40.0] * 10          # p99 well past 5 ms
ON_TIME = [0.5] * 99 + [40.0]            # one outlier: p99 = 0.5 + 0.01 * 39.5 = 0.895 ms


def test_a_missed_goal_fails_the_run_only_when_required(capsys):
    s = summary(LATE)
    assert s["delivery_error_ms"]["goal_applies"] and not s["delivery_error_ms"]["goal_met"]
    assert runner.clean(s, "poisson")                     # reported, never enforced by default
    assert not runner.clean(s, "poisson", require_delivery=True)
    err = capsys.readouterr().err
    p99 = s["delivery_error_ms"]["p99"]
    assert f"p99 delivery error {p99:.2f} ms > 5 ms goal" in err, err
    assert "orchard" in err and "--require-delivery" in err, err


def test_a_met_goal_or_a_rate_beyond_it_passes_when_required():
    s = summary(ON_TIME)
    assert s["delivery_error_ms"]["p99"] == pytest.approx(0.895)
    assert report.delivery_failure(s) is None and runner.clean(s, "poisson", True)
    # 100 requests in 2.475 s: 40 req/s, beyond the rates the goal is stated for.
    fast = summary(LATE, every_s=0.025)
    assert not fast["delivery_error_ms"]["goal_applies"]
    assert report.delivery_failure(fast) is None and runner.clean(fast, "poisson", True)


def test_a_pooled_summary_keeps_one_runs_rate_for_the_goal():
    """Three replays of a 1 req/s schedule are still 1 req/s: pooling must not lift the goal
    (the pooled records over one run's span would count 3 req/s per second)."""
    runs = []
    for _ in range(3):
        recs = [sent_late(i, late, every_s=0.15) for i, late in enumerate(LATE)]
        s = report.summarize(recs, {"scenario": "poisson"}, 2000, 200)
        s["capacity_after"], s["host"], s["files"] = {"idle": True}, {}, {}
        runs.append((s, recs))
    assert runs[0][0]["delivery_error_ms"]["goal_applies"]      # 6.7 req/s
    pooled = report.pool(runs, {"scenario": "poisson"}, 2000, 200)
    assert pooled["delivery_error_ms"]["goal_applies"]
    assert "delivery goal missed" in report.delivery_failure(pooled)


@pytest.mark.parametrize("module", [runner, bench_serve])
def test_both_runners_take_the_flag(module):
    base = ["--host", "http://x"] if module is runner else ["--target", "label=a,url=http://x"]
    assert module.parser().parse_args(base + ["--require-delivery"]).require_delivery
    assert not module.parser().parse_args(base).require_delivery
