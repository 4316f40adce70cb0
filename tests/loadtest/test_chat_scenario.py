"""The multi-turn chat scenario: its plan (deterministic, several tenants, 4-8 turns by default,
bad parameters refused by name) and a short real run through Locust against the served app,
where every later turn resends the history and the server reports most of it as cached."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loadtest import chat_plan
from tests.fixtures.serve import TEST_API_KEY, TEST_API_KEY_OTHER, TEST_MODEL


def test_plan_is_deterministic_and_spreads_tenants():
    p = chat_plan.ChatParams(conversations=6, tenants=3, seed=7)
    plan = chat_plan.build(p)
    assert chat_plan.to_json(p, plan) == chat_plan.to_json(p, chat_plan.build(p))
    assert {c.tenant for c in plan} == {0, 1, 2}
    assert all(4 <= len(c.users) <= 8 for c in plan)
    # No two conversations share an opening by accident (only the persona's first words).
    assert len({c.system[40:] for c in plan}) == len(plan)
    again = chat_plan.from_json(chat_plan.to_json(p, plan))
    assert again[0] == p and [c.users for c in again[1]] == [c.users for c in plan]


@pytest.mark.parametrize("bad, field", [(dict(min_turns=5, max_turns=4), "min_turns"),
                                        (dict(user_words=(0, 3)), "user_words"),
                                        (dict(tenants=0), "tenants")])
def test_bad_parameters_are_refused_by_name(bad, field):
    with pytest.raises(ValueError, match=field):
        chat_plan.ChatParams(**bad)


@pytest.mark.slow
def test_short_run_reports_the_history_served_from_cache(orchard_url, tmp_path):
    out = tmp_path / "chat"
    cmd = [sys.executable, "-m", "loadtest", "chat", "--out", str(out),
           "--target", f"label=orchard,url={orchard_url},model={TEST_MODEL}",
           "--conversations", "3", "--min-turns", "3", "--max-turns", "3", "--tenants", "2",
           "--max-tokens", "8", "--think-s", "0.1", "--stagger-s", "0.2"]
    env = {**os.environ, "ORCHARD_LOADTEST_API_KEYS": f"{TEST_API_KEY},{TEST_API_KEY_OTHER}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())["targets"]["orchard"]
    assert (s["turns"], s["ok"], s["conversations"]) == (9, 9, 3)
    assert s["ttft_p50_turn1_ms"] > 0 and s["ttft_p50_turns2plus_ms"] > 0
    # One replica: every later turn finds its history's whole pages in that replica's cache.
    assert s["cached_share_of_history"] > 0.6, s
    records = json.loads((out / "chat_records.json").read_text())["records"]
    later = [r for r in records if r["turn"] >= 2]
    assert all(r["history_tokens"] < r["prompt_tokens"] for r in later)
    assert all(r["cached_tokens"] <= r["history_tokens"] for r in later)
