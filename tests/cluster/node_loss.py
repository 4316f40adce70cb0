"""A node lost without closing its sockets, run from the client namespace by
tests/cluster/test_node_loss.py.

Two orchard-tiny replicas, one per node (`max_replicas_per_node: 1`): one on the head, one on
the worker. While streams run on the worker's replica, the worker's cable is pulled: its port
on the switch is set down (`ip link set p-worker down` in the switch namespace). Every process
of the worker keeps running and every socket stays open on both sides, but no packet flows
either way, and no FIN or RST ever reaches the head: what a power cut or a pulled cable looks
like to the rest of the fleet. Only timeouts can detect it, so the bounds this scenario
reports come from the configured timeouts (`bounds`). Prints one line `FACTS {json}`.

    python -m tests.cluster.node_loss SPEC_JSON WORKDIR
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import yaml

from tests.cluster.netns import cluster_commands
from tests.cluster.scenario import (API_KEY, MODEL, Cluster, Load, deploy_config, job_submit,
                                    only_if, report_facts, wait_until)

PROBE_EVERY_S = 0.5           # the prober's open-loop arrivals: one new request each interval

STREAM_TOKENS = 3000          # long enough to still be streaming when the cable is pulled

# What a loaded box adds before a verdict is seen from here: the GCS's publication to the
# ingress and Serve's routers, the error event relayed by the ingress, the dashboard's answer to
# this scenario's polls (0.2-0.3 s past the GCS's bound with 1 s checks, load average 5-51).
SEEN_WITHIN_S = 2.0


def two_node_config(repo: str) -> dict:
    """scenario.py's deployment, but two replicas spread one per node (no `mac` pin)."""
    cfg = deploy_config(repo)
    cfg["models"][0].update(replicas=2, max_replicas_per_node=1,
                            resources={"num_cpus": 0})
    return cfg


def bounds(spec: dict, cfg: dict) -> dict:
    """How long detection may take, from the configured timeouts (seconds).

    Nothing closes a socket, so the head learns of the loss only from Ray's GCS health checks
    of the worker's raylet: a check every `health_check_period_ms`, each failing after
    `health_check_timeout_ms` at worst, the node dead after `health_check_failure_threshold`
    failures in a row. From the cut to the next check is at most one period, so the GCS
    declares the node dead within threshold x (timeout + period). Its actors die with it;
    the ingress's core worker (the owner of each stream's generator task) fails the streams,
    Serve's routers drop the replica and tell the capacity actor (`retire`). Independently,
    the capacity ledger stops counting a replica silent for `stale_after_s` (its feed's
    `replicas`). The values are Ray's and the ledger's own defaults, overridden where
    cluster.yaml's head start command sets RAY_health_check_* (it sets all three: 10 s)."""
    from ray._raylet import Config

    from capacity.ledger import LedgerConfig

    ray_cfg = {name: getattr(Config, name)() for name in (
        "health_check_period_ms", "health_check_timeout_ms", "health_check_failure_threshold")}
    head_cmds = " ".join(cluster_commands(Path(spec["cluster_yaml"]))["head"])
    for name, value in re.findall(r"RAY_(health_check_\w+)=(\d+)", head_cmds):
        ray_cfg[name] = int(value)
    period = ray_cfg["health_check_period_ms"] / 1000
    timeout = ray_cfg["health_check_timeout_ms"] / 1000
    gcs_dead_s = ray_cfg["health_check_failure_threshold"] * (timeout + period)
    stale_s = LedgerConfig().stale_after_s
    return {"ray": ray_cfg, "gcs_node_dead_s": gcs_dead_s, "seen_within_s": SEEN_WITHIN_S,
            # The cut lands up to one health-check period after the last check that passed, so
            # the failing checks start within `period` of it; the GCS's verdict then reaches the
            # ingress and Serve's routers by publication, within one more period, or
            # SEEN_WITHIN_S where that is longer (CI once saw a stream end at 12.1 s against a
            # bound without the first term's phase, 12.0 s).
            "stream_ends_s": gcs_dead_s + period + max(period, SEEN_WITHIN_S),
            "feed_replicas_s": stale_s + cfg["capacity"]["heartbeat_interval_s"],
            "stale_after_s": stale_s}


class LongStream(threading.Thread):
    """One long streaming chat request read to its end; what the client saw, and when."""

    def __init__(self, url: str, read_timeout_s: float):
        super().__init__(daemon=True)
        self.url, self.read_timeout_s = url, read_timeout_s
        self.first_content = threading.Event()
        self.stop = threading.Event()      # set: the client goes away (closes the connection)
        self.out: dict = {"outcome": "running"}

    def run(self) -> None:
        body = {"model": MODEL, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "tell me a very long story"}]}
        out = self.out
        out["t0"] = time.time()
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              timeout=httpx.Timeout(30, read=self.read_timeout_s)) as r:
                out["status"], out["replica"] = r.status_code, r.headers.get("x-orchard-replica")
                if r.status_code != 200:
                    r.read()
                    out.update(outcome="refused" if r.status_code in (429, 503) else "bad",
                               error=r.text[:200])
                    return
                done, error, n = False, None, 0
                for line in r.iter_lines():
                    if self.stop.is_set():
                        out.update(outcome="closed_by_client", content_events=n)
                        return
                    out["t_last_byte"] = time.time()
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and '"error"' in line:
                        error = json.loads(line[6:])["error"].get("code")
                    elif line.startswith("data: ") and '"content"' in line:
                        n += 1
                        self.first_content.set()
                out["content_events"] = n
                out.update(outcome="error_event" if error else ("ok" if done else "truncated"),
                           error=error, done=done)
        except httpx.TimeoutException as e:
            out.update(outcome="hang", error=type(e).__name__)
        except Exception as e:  # noqa: BLE001 - a broken stream is an outcome, reported
            out.update(outcome="transport_error", error=f"{type(e).__name__}: {e}")
        finally:
            out["t1"] = time.time()
            self.first_content.set()      # never leave a waiter behind


class Prober(threading.Thread):
    """Open-loop arrivals: a new short request (streams and plain ones in turn) every
    PROBE_EVERY_S, each on its own thread, so a request stuck on the lost node never delays
    the next one. Records when each started and ended, where it was served, what it saw
    (scenario.Load's request and outcome rules)."""

    def __init__(self, url: str, read_timeout_s: float):
        super().__init__(daemon=True)
        self.url, self.read_timeout_s = url, read_timeout_s
        self.halt = threading.Event()
        self.records: list[dict] = []
        self.threads: list[threading.Thread] = []
        self.load = Load(url, clients=0, max_tokens=8, timeout_s=read_timeout_s)

    def run(self) -> None:
        n = 0
        while not self.halt.wait(PROBE_EVERY_S):
            t = threading.Thread(target=self._one, args=(n % 2 == 0,), daemon=True)
            t.start()
            self.threads.append(t)
            n += 1

    def _one(self, stream: bool) -> None:
        client = httpx.Client(base_url=self.url, timeout=self.read_timeout_s,
                              headers={"Authorization": f"Bearer {API_KEY}"})
        t0 = time.time()
        try:
            rec = self.load._one(client, stream)
        except Exception as e:  # noqa: BLE001 - reported as an outcome
            rec = {"outcome": "transport_error", "error": f"{type(e).__name__}: {e}"}
        finally:
            client.close()
        rec.update(t0=t0, t1=time.time(), stream=stream)
        self.records.append(rec)

    def finish(self) -> list[dict]:
        self.halt.set()
        self.join()
        for t in self.threads:
            t.join(self.read_timeout_s + 10)
        return sorted(self.records, key=lambda r: r["t0"])


def cut_cable(spec: dict, role: str) -> None:
    """Set the node's port on the switch down: its processes and sockets stay as they are,
    nothing flows in or out, and nobody on the LAN is told."""
    subprocess.run(["ip", "-n", f"{spec['tag']}-sw", "link", "set", f"p-{role}", "down"],
                   check=True, capture_output=True, text=True)


def main(spec: dict, workdir: str, facts: dict) -> dict:
    """Fills `facts` as it goes, so that a scenario cut short still reports what it saw."""
    c = Cluster(spec)
    head_ip, worker_ip = spec["nodes"]["head"]["ip"], spec["nodes"]["worker"]["ip"]
    ips, _ = wait_until("both nodes alive",
                        lambda: only_if(c.alive_ips(), lambda a: len(a) == 2), 60)
    facts["nodes"] = ips
    worker_node = ips[worker_ip]

    cfg = two_node_config(spec["repo"])
    b = bounds(spec, cfg)
    facts["bounds"] = b
    cfg_path = os.path.join(workdir, "config.yaml")
    Path(cfg_path).write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    job = job_submit(spec, cfg_path)
    facts["submit_s"] = round(time.monotonic() - t0, 1)
    facts["submit_rc"] = job.returncode
    facts["job_tail"] = job.stdout[-2500:] + job.stderr[-1500:]
    if job.returncode != 0:
        return facts

    # ---- both replicas up, one per node, both in the feed ----------------------------------
    reps, _ = wait_until("a RUNNING replica on each node", lambda: only_if(
        c.replicas(), lambda r: sorted(x["node_ip"] for x in r.get(f"model-{MODEL}", []))
        == sorted([head_ip, worker_ip])), 120)
    by_ip = {x["node_ip"]: x["replica_id"] for x in reps[f"model-{MODEL}"]}
    facts["placement"] = {d: sorted(x["node_ip"] for x in rs) for d, rs in reps.items()}
    facts["replica_on"] = {"head": by_ip[head_ip], "worker": by_ip[worker_ip]}
    feed, _ = wait_until("the feed to list both replicas",
                         lambda: only_if(c.feed(), lambda f: f.get("replicas") == 2), 60)
    facts["feed_before"] = feed
    wait_until("the ledger idle", lambda: only_if(
        c.api.get("/v1/models/capacity").json(), lambda f: f["outstanding_raw_tokens"] == 0), 30)
    counters_before = c.api.get("/v1/models/capacity").json()["counters"]

    # ---- long streams until one streams from the worker; the prober's arrivals meanwhile ----
    read_timeout = b["stream_ends_s"] + 60        # a client never gives up before the bound
    prober = Prober(c.url, read_timeout)
    prober.start()
    streams: list[LongStream] = []
    on_worker: list[LongStream] = []
    while not on_worker and len(streams) < 12:
        batch = [LongStream(c.url, read_timeout) for _ in range(2)]
        for s in batch:
            s.start()
        for s in batch:
            s.first_content.wait(60)
        streams += batch
        on_worker = [s for s in batch if s.out.get("replica") == by_ip[worker_ip]
                     and s.out["outcome"] == "running"]
    facts["streams_started"] = len(streams)
    # The long streams elsewhere leave (their clients close): the head's replica keeps its
    # slots for the prober's requests.
    for s in streams:
        if s not in on_worker:
            s.stop.set()
    if not on_worker:
        facts["no_stream_on_worker"] = [s.out for s in streams]
        prober.finish()
        return facts

    # ---- pull the cable -------------------------------------------------------------------
    t_cut = time.time()
    cut_cable(spec, "worker")
    seen: dict[str, float] = {}

    def detected():
        """Record each sign of the loss as it is first seen from here."""
        now = time.time()
        if "node_dead" not in seen and c.nodes()[worker_node]["state"] == "DEAD":
            seen["node_dead"] = now
        f = c.feed()
        if f is not None:
            if "feed_replicas_1" not in seen and f.get("replicas") == 1:
                seen["feed_replicas_1"], facts["feed_after_stale"] = now, f
            if "feed_node_dropped" not in seen and worker_node not in f.get("nodes", {}):
                seen["feed_node_dropped"], facts["feed_after_loss"] = now, f
        if "worker_streams_ended" not in seen and all(s.out["outcome"] != "running"
                                                      for s in on_worker):
            seen["worker_streams_ended"] = max(s.out["t1"] for s in on_worker)
        return len(seen) == 4
    wait_until("every sign of the loss", detected, b["stream_ends_s"] + 120, every_s=0.2)
    for what, t in seen.items():
        facts[f"{what}_after_cut_s"] = round(t - t_cut, 1)

    # ---- the prober's requests: served by the head's replica; none hung ---------------------
    t_detected = time.time()
    head_replica = by_ip[head_ip]
    wait_until("a streak of requests served by the head's replica", lambda: sum(
        r["outcome"] == "ok" and r.get("replica") == head_replica
        for r in list(prober.records) if r["t0"] >= t_detected) >= 6, 60)
    recs = prober.finish()
    for s in streams:
        s.join(read_timeout + 10)
    facts["probe_outcomes"] = {}
    for r in recs:
        facts["probe_outcomes"][r["outcome"]] = facts["probe_outcomes"].get(r["outcome"], 0) + 1

    def rel(t: float) -> float:
        return round(t - t_cut, 1)
    facts["probe_not_ok_or_worker"] = [
        {k: r.get(k) for k in ("outcome", "status", "error", "replica", "stream")}
        | {"at_s": rel(r["t0"]), "took_s": round(r["t1"] - r["t0"], 1)}
        for r in recs if r["outcome"] != "ok" or r.get("replica") != head_replica][:60]
    after = [r for r in recs if r["t0"] >= t_cut]
    ok_after = [r for r in after if r["outcome"] == "ok"]
    facts["first_ok_after_cut_s"] = rel(min(r["t1"] for r in ok_after)) if ok_after else None
    # Which new requests waited for the GCS's verdict: routed to the lost replica, they were in
    # flight when the node was declared dead, then ended with an error or were routed again by
    # Serve (served late, by the head). They stand out from this box's own slowness: in flight
    # at detection and over 10x the median latency after the cut. The router stops choosing
    # the silent replica once the feed stops counting it (stale_after_s): the last of them
    # started before that.
    t_dead = min(seen.get("node_dead", time.time()), seen.get("worker_streams_ended", time.time()))
    median = sorted(r["t1"] - r["t0"] for r in after)[len(after) // 2] if after else 0.0
    held = [r for r in after if r["t0"] < t_dead <= r["t1"] + 0.5
            and r["t1"] - r["t0"] > 10 * median]
    facts["probe_median_s"] = round(median, 2)
    facts["held_by_the_loss"] = [{k: r.get(k) for k in ("outcome", "replica", "stream")}
                                 | {"at_s": rel(r["t0"]), "took_s": round(r["t1"] - r["t0"], 1)}
                                 for r in held]
    facts["every_new_request_served_from_s"] = rel(max(r["t0"] for r in held)) if held else 0.0
    others = sorted(r["t1"] - r["t0"] for r in after if r not in held)
    facts["other_probes_max_s"] = round(others[-1], 1) if others else None
    facts["replicas_serving_after_detection"] = sorted(
        {r["replica"] for r in recs if r["t0"] >= t_detected and r["outcome"] == "ok"})
    facts["longest_probe_request_s"] = round(max(r["t1"] - r["t0"] for r in recs), 1)
    # What a request the loss cannot touch (sent once the verdict was seen, routed to the head
    # only) took on this box in this run: its slowness, not the loss's.
    facts["slowest_after_detection_s"] = round(max(
        (r["t1"] - r["t0"] for r in recs if r["t0"] >= t_detected), default=0.0), 1)
    # How long a request stayed open once the cable was pulled (no request waits for ever).
    facts["longest_probe_past_cut_s"] = round(max(r["t1"] - max(r["t0"], t_cut)
                                                  for r in recs), 1)
    facts["probes"] = len(recs)
    facts["worker_streams"] = [{k: s.out.get(k) for k in ("outcome", "status", "error", "done",
                                                           "content_events")}
                               | {"ended_after_cut_s": rel(s.out["t1"])}
                               for s in on_worker]
    facts["other_streams"] = [{k: s.out.get(k) for k in ("outcome", "replica", "error")}
                              for s in streams if s not in on_worker]

    def settled():
        f = c.api.get("/v1/models/capacity").json()
        cnt = f["counters"]
        holds = cnt.get("holds", 0) - counters_before.get("holds", 0)
        releases = cnt.get("releases", 0) - counters_before.get("releases", 0)
        facts["ledger_after"] = {"outstanding_raw_tokens": f["outstanding_raw_tokens"],
                                 "holds": holds, "releases": releases,
                                 "rebuilt": cnt.get("rebuilt", 0), "settled": cnt.get("settled")}
        return f["outstanding_raw_tokens"] == 0 and holds == releases
    t_idle = time.time()
    facts["ledger_settled"] = False
    _, facts["ledger_settle_wait_s"] = wait_until(
        "the ledger idle with holds == releases", settled, b["stale_after_s"] + 120)
    facts["ledger_settled"] = True
    facts["ledger_settled_after_cut_s"] = round(time.time() - t_cut, 1)
    facts["ledger_settled_after_load_s"] = round(time.time() - t_idle, 1)
    return facts


if __name__ == "__main__":
    report_facts(main)
