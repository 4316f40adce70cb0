"""`ray job submit` of a deploy against a locally started head; run by tests/serve_app/test_job.py.

Starts a head node with the dashboard (the Jobs API lives there) through
`ray.cluster_utils.Cluster`, so shutting it down kills only its own processes (`ray stop`
would kill every Ray on the machine). Then, exactly as docs/serving.md says, submits
`--working-dir . -- <deploy CONFIG>` from the repository root, waits for the job, and checks
that the deployed app answers after the job has exited (Serve apps outlive their driver).
Then `serve run serve_app.app:app_builder config=PATH` deploys a second app on the same
cluster (route prefix /run), as docs/serving.md says. Prints one JSON line of facts.

    RAY_TMPDIR=/tmp/x python -m tests.serve_job_check MODEL_DIR CONFIG_DIR
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import yaml


def main(model_dir: str, config_dir: str) -> dict:
    from ray.cluster_utils import Cluster

    from serve_app.launch import LOCAL_RAY_SYSTEM_CONFIG, start_with_retry, with_agent_ports
    from tests.fixtures.serve import free_port, make_config, wait_http_ok

    facts: dict = {}
    dash_port = free_port()
    head_args = {
        "num_cpus": 2, "gcs_server_port": free_port(), "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": dash_port,
        # Fixed defaults (52365, ...) collide with other Ray instances on a shared machine.
        "dashboard_agent_listen_port": free_port(), "runtime_env_agent_port": free_port(),
        "metrics_export_port": free_port(),
        # As `orchard serve`'s local Ray and cluster.yaml's nodes: workers at normal priority.
        # At Ray's default (niceness 15) Serve's controller, proxy, the capacity actor and the
        # replica got about 3 % of a core each next to one busy loop per core, and the job's
        # deploy ran past the 300 s below (issue 34).
        "_system_config": LOCAL_RAY_SYSTEM_CONFIG}
    cluster = Cluster()
    t0 = time.monotonic()
    # The head's raylet may miss Ray's fixed 30 s registration wait on a busy machine. Without
    # the daemons orchard does not use (launch.LOCAL_RAY_PARAMS), as orchard serve's Ray.
    start_with_retry(with_agent_ports(lambda: cluster.add_node(**head_args)))
    facts["head_start_s"] = round(time.monotonic() - t0, 1)
    try:
        http_port = free_port()
        cfg_path = os.path.join(config_dir, "config.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(make_config(model_dir, http_port, "orchard-job"), f)
        env = {**os.environ, "RAY_ADDRESS": f"http://127.0.0.1:{dash_port}"}
        t0 = time.monotonic()
        for _ in range(5):
            proc = subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit",
                 "--working-dir", ".", "--",
                 sys.executable, "-m", "serve_app.cli", "deploy", cfg_path],
                env=env, capture_output=True, text=True, timeout=300)
            # On a loaded machine the head's job agent can lag the head itself.
            if "No available agent to submit job" not in proc.stderr:
                break
            time.sleep(5)
        facts["submit_s"] = round(time.monotonic() - t0, 1)
        facts["submit_rc"] = proc.returncode
        facts["job_output_tail"] = proc.stdout[-3000:] + proc.stderr[-1000:]
        url = f"http://127.0.0.1:{http_port}"
        if proc.returncode != 0:
            return facts
        wait_http_ok(url + "/health", timeout_s=60)
        facts["chat_status"], facts["completion_tokens"] = chat(url, "tiny", 3)
        status = subprocess.run(
            [sys.executable, "-m", "serve_app.cli", "status", "--app", "orchard-test",
             "--namespace", "orchard-job", "--address", cluster.address],
            env=env, capture_output=True, text=True, timeout=120)
        facts["status_rc"] = status.returncode
        facts["status_out"] = status.stdout[-2000:] + status.stderr[-2000:]
        serve_run(model_dir, config_dir, cluster.address, url, env, facts)
        return facts
    finally:
        cluster.shutdown()


def serve_run(model_dir: str, config_dir: str, address: str, url: str, env: dict,
              facts: dict) -> None:
    """`serve run serve_app.app:app_builder config=PATH` (docs/serving.md) as a second app on the
    same cluster, under its own route prefix, model id and capacity namespace."""
    from tests.fixtures.serve import make_config, wait_http_ok

    # Serve is already running on this cluster; its proxy keeps the port it has.
    cfg = make_config(model_dir, int(url.rsplit(":", 1)[1]), "orchard-run")
    cfg["models"][0]["id"] = "tiny-run"
    path = os.path.join(config_dir, "serve-run.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "serve"), "run", "--address", address,
         "--non-blocking", "--name", "orchard-run", "--route-prefix", "/run",
         "serve_app.app:app_builder", f"config={path}"],
        env=env, capture_output=True, text=True, timeout=300)
    facts["serve_run_rc"] = proc.returncode
    facts["serve_run_tail"] = proc.stdout[-2000:] + proc.stderr[-2000:]
    if proc.returncode != 0:
        return
    wait_http_ok(url + "/run/health", timeout_s=120)
    facts["serve_run_chat_status"], facts["serve_run_completion_tokens"] = chat(
        url + "/run", "tiny-run", 2)


def chat(base_url: str, model: str, max_tokens: int) -> tuple[int, int | None]:
    """One chat completion: (HTTP status, completion tokens from usage)."""
    from tests.fixtures.serve import TEST_API_KEY

    r = httpx.post(base_url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {TEST_API_KEY}"},
                   json={"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    return r.status_code, r.json().get("usage", {}).get("completion_tokens")


if __name__ == "__main__":
    print("FACTS " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
