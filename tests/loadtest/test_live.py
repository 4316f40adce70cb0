"""A short headless run against a live OpenAI-compatible server, asserting on its own summary:
no errors below capacity, TTFT for every served request, delivery error reported."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SMOKE = ["--scenario", "smoke", "--duration", "8", "--rate", "2", "--context", "512",
         "--max-tokens", "16", "--stream-timeout", "60", "--drain-timeout", "60"]


def run_smoke(url: str, model: str | None, out, label: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "loadtest", "run", "--host", url, "--label", label,
           "--out", str(out), *SMOKE, *extra] + (["--model", model] if model else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def check_clean(s: dict) -> None:
    c = s["counts"]
    assert c["scheduled"] >= 8 and c["ok"] == c["scheduled"], (c, s["error_examples"])
    assert c["refused"] == c["error"] == c["hung"] == c["unsent"] == 0
    assert s["ttft_recorded_for_every_ok"] and s["metrics"]["ttft_ms"]["n"] == c["ok"]
    assert s["usage_missing"] == 0  # token counts came from the server's usage
    assert 0 < s["metrics"]["output_tokens"]["p50"] <= 16
    d = s["delivery_error_ms"]
    assert d["n"] == c["sent"] and d["p50"] is not None and d["p99"] is not None
    assert d["p50"] >= 0
    assert s["throughput"]["output_tokens_per_s"] > 0


def test_smoke_against_mlx_lm_server(peer_server, tmp_path):
    s = run_smoke(peer_server.url, peer_server.model, tmp_path / "peer", "mlx_lm.server")
    check_clean(s)
    assert s["target"]["label"] == "mlx_lm.server"
    assert (tmp_path / "peer" / "ttft_cdf.png").stat().st_size > 0


def test_smoke_against_orchard(orchard_url, tmp_path, monkeypatch):
    from tests.fixtures.serve import TEST_API_KEY, TEST_MODEL

    monkeypatch.setenv("ORCHARD_API_KEY", TEST_API_KEY)
    s = run_smoke(orchard_url, TEST_MODEL, tmp_path / "orchard", "orchard", "--no-plots")
    check_clean(s)
    assert s["capacity_after"]["checked"] and s["capacity_after"]["idle"], s["capacity_after"]
