"""ORCHARD_STEP_LOG: a replica engine's steps as JSON lines (serve_app/step_log.py)."""
from __future__ import annotations

import json

import pytest

from serve_app.step_log import STEP_LOG_ENV, step_log_from_env
from tests.engine_helpers import collect, make_engine, req, run

pytestmark = pytest.mark.unit


def test_unset_means_no_trace(monkeypatch):
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    assert step_log_from_env() is None


def test_steps_are_logged_with_their_work(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "steps"))
    eng = make_engine(tiny_llama, trace=step_log_from_env())
    try:
        deltas = run(collect(eng, req("a", n_prompt=20, max_tokens=5, ignore_eos=True)))
    finally:
        eng.shutdown()
    assert sum(len(d.token_ids) for d in deltas) == 5
    (path,) = tmp_path.glob("steps.*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [x for x in lines if x["event"] == "step"]
    assert sum(s["prefill_tokens"] for s in steps) == 20
    assert sum(s["decode_rows"] for s in steps) == 4     # the first token comes from prefill
    assert all(s["seconds"] > 0 and s["model_calls"] >= 1 for s in steps)
    assert [x["event"] for x in lines if x["event"] != "step"][:2] == ["arrival", "admit"]
