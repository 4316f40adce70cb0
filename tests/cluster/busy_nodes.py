"""Busy nodes are not lost ones, run from the client namespace by tests/cluster/test_busy_nodes.py.

cluster.yaml's head command shortens Ray's GCS health checks so that a node that vanishes
without closing its sockets is declared dead within seconds (tests/cluster/node_loss.py). The
risk of a short detection bound is a false positive: a node busy enough to miss its checks
declared dead, its replicas killed. Here both nodes serve mixed load (streams and plain
requests through the head's ingress, one orchard-tiny replica per node) while a busy loop runs
on every core of the machine (both nodes share it), for several detection bounds; the GCS's
view of the nodes is read throughout. Prints one line `FACTS {json}`.

    python -m tests.cluster.busy_nodes SPEC_JSON WORKDIR
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.cluster.node_loss import bounds, two_node_config
from tests.cluster.scenario import (MODEL, Cluster, Load, job_submit, only_if, report_facts,
                                    wait_until)

# How long the load and the busy loops last, in detection bounds: a node that misses its checks
# under this load does so well within it.
SOAK_BOUNDS = 6
HOG = "while True: pass"


def main(spec: dict, workdir: str, facts: dict) -> dict:
    """Fills `facts` as it goes, so that a scenario cut short still reports what it saw."""
    c = Cluster(spec)
    head_ip, worker_ip = spec["nodes"]["head"]["ip"], spec["nodes"]["worker"]["ip"]
    ips, _ = wait_until("both nodes alive",
                        lambda: only_if(c.alive_ips(), lambda a: len(a) == 2), 60)
    facts["nodes"] = ips
    cfg = two_node_config(spec["repo"])
    b = bounds(spec, cfg)
    facts["bounds"] = b
    cfg_path = os.path.join(workdir, "config.yaml")
    Path(cfg_path).write_text(yaml.safe_dump(cfg))
    job = job_submit(spec, cfg_path)
    facts["submit_rc"] = job.returncode
    facts["job_tail"] = job.stdout[-2500:] + job.stderr[-1500:]
    if job.returncode != 0:
        return facts
    wait_until("a RUNNING replica on each node", lambda: only_if(
        c.replicas(), lambda r: sorted(x["node_ip"] for x in r.get(f"model-{MODEL}", []))
        == sorted([head_ip, worker_ip])), 120)
    replicas_before = {x["replica_id"] for x in c.replicas()[f"model-{MODEL}"]}

    soak_s = SOAK_BOUNDS * b["gcs_node_dead_s"]
    facts["soak_s"] = soak_s
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
    load = Load(c.url, clients=6, max_tokens=48, timeout_s=60).start()
    states: dict[str, set] = {nid: set() for nid in ips.values()}
    load_avgs = []
    t0 = time.monotonic()
    try:
        def soaked():
            for nid, node in c.nodes().items():
                states.setdefault(nid, set()).add(node["state"])
            load_avgs.append(os.getloadavg()[0])
            return time.monotonic() - t0 >= soak_s
        wait_until("the soak's end", soaked, soak_s + 60, every_s=0.5)
    finally:
        load.finish()
        for h in hogs:
            h.kill()
            h.wait()
    facts["node_states_seen"] = {nid: sorted(s) for nid, s in states.items()}
    recs = load.snapshot()
    facts["requests"] = len(recs)
    facts["outcomes"] = {}
    for r in recs:
        facts["outcomes"][r["outcome"]] = facts["outcomes"].get(r["outcome"], 0) + 1
    facts["not_ok"] = [r for r in recs if r["outcome"] != "ok"][:20]
    # A replica lost (or thought lost) shows as this code, in an error event or a 503.
    facts["replica_unavailable"] = sum("replica_unavailable" in (r.get("error") or "")
                                       for r in recs)
    facts["load_average_max"] = round(max(load_avgs), 1)
    facts["load_average_median"] = round(sorted(load_avgs)[len(load_avgs) // 2], 1)
    facts["replicas_after"] = sorted(x["replica_id"] for x in c.replicas()[f"model-{MODEL}"])
    facts["replicas_replaced"] = sorted(set(facts["replicas_after"]) ^ replicas_before)
    return facts


if __name__ == "__main__":
    report_facts(main)
