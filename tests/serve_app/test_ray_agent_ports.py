"""A local Ray start does not depend on how fast its Python agents start (serve_app/launch.py
with_agent_ports; issue 34).

Ray's raylet waits 15 s for each port file its agents (dashboard agent, runtime-env agent) write
once they have imported and bound, then aborts and the node never registers. On a box whose cores
are all busy the agents' imports took longer than that: `orchard serve` failed all three start
attempts. With the ports chosen up front the raylet does not wait for the files; it then waits
for the runtime-env agent's connection, up to agent_register_timeout_ms (raised for local starts,
launch.LOCAL_RAY_SYSTEM_CONFIG).

The Ray test makes that fault happen on a quiet machine: a sitecustomize on the child's
PYTHONPATH holds every agent process AGENT_DELAY_S before it runs (longer than both of Ray's
waits), and writes a marker so the test knows the fault was injected. The start must succeed on
its first attempt and the cluster must run a task (which needs the runtime-env agent).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from serve_app import launch

REPO = Path(__file__).resolve().parents[2]
# Longer than the raylet's wait per port file (15 s) and its default wait for the runtime-env
# agent's connection (agent_register_timeout_ms, 30 s), both of which ended the start.
AGENT_DELAY_S = 40
# The injected fault: run by every Python process of the child's Ray, it holds only the agents.
SLOW_AGENTS = """\
import os, sys, time
_main = " ".join(sys.orig_argv)
if "dashboard/agent.py" in _main or "runtime_env/agent/main.py" in _main:
    open(os.path.join(os.environ["ORCHARD_SLOW_AGENT_MARKS"], str(os.getpid())), "w").close()
    time.sleep(float(os.environ["ORCHARD_SLOW_AGENT_DELAY_S"]))
"""


def test_the_ports_reach_ray_params_and_the_raylet_for_that_call_only():
    from ray._private import parameter, ray_constants, services

    base_params, base_start, made, started = parameter.RayParams, services.start_ray_process, [], []

    def fake_start_ray_process(command, process_type, *args, **kwargs):
        started.append((process_type, command))

    services.start_ray_process = fake_start_ray_process
    try:
        def start():   # as ray.init builds them: the export port passed as None, the rest defaulted
            made.append(parameter.RayParams(metrics_export_port=None,
                                            runtime_env_agent_port=4242))
            services.start_ray_process(["raylet", "--x"], ray_constants.PROCESS_TYPE_RAYLET)
            services.start_ray_process(["gcs_server"], ray_constants.PROCESS_TYPE_GCS_SERVER)
            return "started"

        assert launch.with_agent_ports(start)() == "started"
        assert (parameter.RayParams, services.start_ray_process) == (base_params,
                                                                      fake_start_ray_process)
    finally:
        services.start_ray_process = base_start
    [p] = made
    chosen = [p.metrics_agent_port, p.metrics_export_port, p.dashboard_agent_listen_port]
    assert all(chosen) and len(set(chosen)) == 3, chosen
    assert p.runtime_env_agent_port == 4242          # a port the call sets itself stays
    assert started == [
        (ray_constants.PROCESS_TYPE_RAYLET,
         ["raylet", "--x", f"--dashboard_agent_listen_port={p.dashboard_agent_listen_port}"]),
        (ray_constants.PROCESS_TYPE_GCS_SERVER, ["gcs_server"])]


def test_ray_is_restored_when_the_start_fails():
    from ray._private import parameter, services

    base = parameter.RayParams, services.start_ray_process

    def start():
        raise Exception("The current node timed out during startup")

    with pytest.raises(Exception, match="timed out"):
        launch.with_agent_ports(start)()
    assert (parameter.RayParams, services.start_ray_process) == base


@pytest.mark.ray
@pytest.mark.slow
def test_a_local_start_does_not_wait_for_slow_agents(tmp_path):
    slow = tmp_path / "slow"
    marks = tmp_path / "marks"
    slow.mkdir()
    marks.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_AGENTS)
    ray_tmp = tempfile.mkdtemp(prefix="ora", dir="/tmp")   # short: Unix socket paths
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(slow), str(REPO)]),
           "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
           "ORCHARD_SLOW_AGENT_MARKS": str(marks),
           "ORCHARD_SLOW_AGENT_DELAY_S": str(AGENT_DELAY_S)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.serve_app.test_ray_agent_ports"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    out = proc.stdout + proc.stderr[-5000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, out[-8000:]
    facts = json.loads(lines[-1].removeprefix("FACTS "))
    assert len(list(marks.iterdir())) >= 2, "the agents were not held: no fault injected"
    assert "did not register" not in proc.stdout, out[-8000:]      # the first start held
    assert facts["task_result"] == 42, facts
    assert all(facts["raylet_agent_ports"].values()), facts


def _child() -> dict:
    """Runs in the child process of the Ray test above: `orchard serve`'s local start."""
    import psutil
    import ray

    launch.connect(None, "orchard-agent-ports-test", start_local=True)

    @ray.remote
    def answer() -> int:
        return 42

    node = ray._private.worker.global_worker.node
    raylet = node.all_processes[ray._private.ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    args = psutil.Process(raylet).cmdline()
    flags = ("--metrics-agent-port", "--metrics_export_port", "--runtime_env_agent_port",
             "--dashboard_agent_listen_port")
    ports = {f: next((int(a.split("=", 1)[1]) for a in args if a.startswith(f + "=")), 0)
             for f in flags}
    facts = {"task_result": ray.get(answer.remote(), timeout=300), "raylet_agent_ports": ports}
    ray.shutdown()
    return facts


if __name__ == "__main__":
    print("FACTS " + json.dumps(_child()), flush=True)
