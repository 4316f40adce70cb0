"""Two-node check, run in its own process by tests/serve_app/test_two_node.py.

It needs a Ray cluster of its own (`ray.cluster_utils.Cluster`), which cannot share a process
with the one-Ray-session-per-run fixture. Both nodes carry the `mac` resource; the head also
carries `head`, which pins the ingress and the capacity actor there, so the worker can be
removed. Prints one JSON line of facts for the test to assert on.

    python -m tests.serve_two_node_check MODEL_DIR
"""
from __future__ import annotations

import json
import os
import sys
import time

import httpx


def replica_nodes(app: str, deployment: str) -> dict[str, str]:
    """replica unique id -> node id, from the GCS actor table (no dashboard needed)."""
    import ray

    out = {}
    for a in ray._private.state.actors().values():
        name = a.get("Name") or ""
        if a["State"] == "ALIVE" and name.startswith(f"SERVE_REPLICA::{app}#{deployment}#"):
            out[name.rsplit("#", 1)[1]] = a["Address"]["NodeID"]
    return out


def served_by(url: str, n: int, key: str, concurrency: int = 1) -> tuple[list[str], int]:
    """Send n small requests (concurrency at a time); return serving replicas and failures."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        try:
            r = httpx.post(url + "/v1/chat/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "tiny", "max_tokens": 16, "temperature": 0,
                                 "ignore_eos": True,
                                 "messages": [{"role": "user", "content": f"hi {i}"}]})
        except httpx.HTTPError:
            return None
        return r.headers["x-orchard-replica"] if r.status_code == 200 else None

    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(one, range(n)))
    return [g for g in got if g], sum(g is None for g in got)


def main(model_dir: str) -> dict:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from capacity.actor import get_or_create_actor
    from engine.platform import openblas_env
    from serve_app.app import build_app, deployment_name
    from serve_app.config import parse_config
    from serve_app.launch import LOCAL_RAY_SYSTEM_CONFIG, with_agent_ports
    from tests.fixtures.serve import TEST_API_KEY, free_port, make_config, wait_http_ok

    facts: dict = {}
    # Both nodes as `orchard serve`'s local Ray starts its one (serve_app/launch.py): the
    # system config (workers at normal priority, the raylet's 600 s wait for its runtime-env
    # agent) is the head's, which the worker's raylet reads from the GCS; every agent port
    # chosen up front (with_agent_ports), so neither raylet aborts after Ray's fixed 15 s wait
    # for an agent's port file. Left at Ray's defaults, a busy machine decided whether the two
    # nodes came up (the same waits ended `orchard serve` starts under `make test-loaded`).
    cluster = with_agent_ports(lambda: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"mac": 1, "head": 1},
        "gcs_server_port": free_port(), "include_dashboard": False,
        "_system_config": LOCAL_RAY_SYSTEM_CONFIG}))()
    worker = with_agent_ports(lambda: cluster.add_node(num_cpus=1, resources={"mac": 1}))()
    try:
        ray.init(address=cluster.address, namespace="orchard-two-node", log_to_driver=False,
                 runtime_env={"env_vars": {**openblas_env(), "PYTHONPATH": os.getcwd()}})
        raw = make_config(model_dir, free_port(), "orchard-two-node", replicas=2,
                          max_replicas_per_node=1, resources={"num_cpus": 0,
                                                              "resources": {"mac": 0.5}})
        raw["ingress_resources"] = {"num_cpus": 0, "resources": {"head": 0.01}}
        cfg = parse_config(raw)
        serve.start(http_options={"host": "127.0.0.1", "port": cfg.http.port},
                    proxy_location="HeadOnly")
        get_or_create_actor(namespace=cfg.capacity.namespace)
        t0 = time.monotonic()
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix="/")
        url = f"http://127.0.0.1:{cfg.http.port}"
        wait_http_ok(url + "/health")
        facts["deploy_s"] = round(time.monotonic() - t0, 1)
        nodes = replica_nodes(cfg.app_name, deployment_name("tiny"))
        facts["replica_nodes"] = sorted(set(nodes.values()))
        facts["cluster_nodes"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        facts["worker_node"] = worker.node_id
        time.sleep(2 * cfg.capacity.heartbeat_interval_s)   # both replicas heartbeat
        # Concurrent, so the actor's per-replica caps spread the load over both replicas.
        before, facts["failures_before"] = served_by(url, 24, TEST_API_KEY, concurrency=8)
        facts["replicas_used_before"] = sorted(set(before))
        facts["replica_node_of"] = nodes

        cluster.remove_node(worker)
        t1 = time.monotonic()
        streak, attempts, after = 0, 0, []
        while streak < 5 and time.monotonic() - t1 < 90:
            got, failed = served_by(url, 1, TEST_API_KEY)
            attempts += 1
            streak = streak + 1 if got else 0
            after += got
            if not got:
                time.sleep(0.5)
        facts["recovered_s"] = round(time.monotonic() - t1, 1)
        facts["streak_after_removal"] = streak
        facts["attempts_after_removal"] = attempts
        facts["replicas_used_after"] = sorted(set(after[-5:]))
        return facts
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":
    print("FACTS " + json.dumps(main(sys.argv[1])), flush=True)
