"""The whole runner (Locust child process) against a scripted stub server: TTFT is the first
token, not the end of the stream; refusals, 5xx, missing Retry-After and hung streams are each
classified and fail the overload rules."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.fixtures.peer_server import FIRST_TOKEN_S, TOKENS


@pytest.mark.slow
def test_overload_classification_against_stub(openai_stub, tmp_path):
    stub_url = openai_stub(faults=True)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "loadtest", "run", "--host", stub_url, "--scenario", "overload",
           "--burst-period", "1", "--duration", "2", "--max-tokens", "8",
           "--stream-timeout", "3", "--drain-timeout", "10", "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the run must not pass
    assert time.monotonic() - t0 < 60
    s = json.loads((out / "summary.json").read_text())
    # capacity 2 from the feed -> 3x = bursts of 6, two bursts
    assert s["counts"]["scheduled"] == 12 and s["counts"]["sent"] == 12
    assert s["counts"]["ok"] == 3 and s["counts"]["refused"] == 5
    assert s["refusals_by_status"] == {"429": 3, "503": 2}
    assert s["refusals_without_retry_after"] == 2
    assert s["errors_by_status"] == {"500": 2, "hung": 2}
    rules = s["overload_rules"]
    assert not rules["passed"] and not rules["refusals_carry_retry_after"]
    assert not rules["zero_other_5xx"] and not rules["zero_hung_streams"]
    # TTFT is the first token (~0.3 s), not the stream's end (~0.5 s)
    ttft, e2e = s["metrics"]["ttft_ms"], s["metrics"]["e2e_ms"]
    assert 250 <= ttft["p50"] <= 400, ttft
    assert e2e["p50"] - ttft["p50"] >= 150, (ttft, e2e)
    assert s["metrics"]["output_tokens"]["p50"] == TOKENS
    assert s["capacity_after"]["idle"] is True
    assert s["delivery_error_ms"]["n"] == 12 and s["delivery_error_ms"]["p99"] is not None
    for f in ("locust.html", "locust_stats.csv", "ttft_cdf.png", "refusals.png",
              "output_tokens_per_s.png"):
        assert (out / f).stat().st_size > 0, f
    stats = (out / "locust_stats.csv").read_text()
    assert "ttft_ms [stub|-]" in stats and "delivery_error_ms [stub|-]" in stats


@pytest.mark.slow
def test_refused_requests_are_retried_after_retry_after(openai_stub, tmp_path):
    url = openai_stub(refuse_every=2)  # streams 0, 2, 4, ... are refused once (429, 0.2 s)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "loadtest", "run", "--host", url, "--scenario", "bursts",
           "--burst-size", "4", "--burst-period", "1", "--duration", "2", "--max-tokens", "8",
           "--retry-refused", "3", "--no-plots", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["counts"]["ok"] == 8 and s["counts"]["refused"] == 0
    retried = s["retried_after_refusal"]
    assert retried["requests"] >= 3 and retried["then_served"] == retried["requests"]
    # a retried request's TTFT counts from its first attempt: >= Retry-After + first token
    assert s["metrics"]["ttft_ms"]["max"] >= (0.2 + FIRST_TOKEN_S) * 1000
