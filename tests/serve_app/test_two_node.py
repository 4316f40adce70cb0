"""Two nodes carrying the Mac resource: replicas on both, routing to both, survival of one.

Runs tests/serve_two_node_check.py in a subprocess because it needs a Ray cluster of its own
(ray.cluster_utils.Cluster), which cannot share this process with the one-session fixture.
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
def test_two_nodes_spread_route_and_survive_node_removal(tiny_llama):
    env = {**os.environ, **openblas_env(), "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_raylet_start_wait_time_s": "180",
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="ort", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.serve_two_node_check", tiny_llama],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    facts = json.loads(lines[-1].removeprefix("FACTS "))
    assert len(facts["cluster_nodes"]) == 2
    assert facts["replica_nodes"] == facts["cluster_nodes"], facts      # one replica per node
    assert facts["failures_before"] == 0, facts
    assert len(facts["replicas_used_before"]) == 2, facts                # routed to both
    assert facts["streak_after_removal"] == 5, facts                      # service survived
    [survivor] = facts["replicas_used_after"]
    assert facts["replica_node_of"][survivor] != facts["worker_node"], facts
