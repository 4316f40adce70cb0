"""`ray job submit --working-dir . -- <deploy CONFIG>` against a locally started head.

Runs tests/serve_job_check.py in a subprocess (it needs a Ray head of its own, with the
dashboard for the Jobs API). RAY_TMPDIR keeps its address file away from /tmp/ray, so other
Ray users on the machine never auto-connect to it.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engine.platform import openblas_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ray
@pytest.mark.slow
def test_job_submit_deploys_a_serving_app(tiny_llama, tmp_path_factory):
    ray_tmp = tempfile.mkdtemp(prefix="ort", dir="/tmp")  # short: Unix socket paths
    env = {**os.environ, **openblas_env(), "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp,
           "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_raylet_start_wait_time_s": "180"}
    env.pop("RAY_ADDRESS", None)
    cfg_dir = tmp_path_factory.mktemp("jobcfg")
    proc = subprocess.run([sys.executable, "-m", "tests.serve_job_check", tiny_llama,
                           str(cfg_dir)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    facts = json.loads(lines[-1].removeprefix("FACTS "))
    assert facts["submit_rc"] == 0, facts["job_output_tail"]
    assert "deployed orchard-test" in facts["job_output_tail"], facts["job_output_tail"]
    assert facts["chat_status"] == 200 and facts["completion_tokens"] == 3, facts
    # `orchard status` on the same cluster: Serve view plus the capacity feed.
    out = facts["status_out"]
    assert facts["status_rc"] == 0, out
    assert "application orchard-test: running" in out and "model-tiny: healthy (1 running)" in out
    assert "model_id=tiny" in out and "identity=native" in out, out
    # `serve run serve_app.app:app_builder config=PATH` on the same cluster, second app.
    assert facts.get("serve_run_rc") == 0, facts.get("serve_run_tail")
    assert facts["serve_run_chat_status"] == 200, facts
    assert facts["serve_run_completion_tokens"] == 2, facts
