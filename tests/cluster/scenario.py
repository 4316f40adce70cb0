"""The two-node scenario, run from the client namespace by tests/cluster/test_netns.py.

Everything here goes over the network namespaces' LAN, as from an operator's laptop: the Jobs
API and the state API on the head's dashboard (token auth), chat through the head's ingress,
and `ss` in the head's namespace for the capacity actor's direct-transport connections. The
node faults act on processes through the harness (tests/cluster/netns.py). Prints one line
`FACTS {json}` for the test to assert on.

    python -m tests.cluster.scenario SPEC_JSON WORKDIR
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from tests.cluster.netns import in_node, kill_raylet, node_from_spec, restart_node

API_KEY = "sk-orchard-cluster"
MODEL = "tiny"
APP = "orchard"
HTTP_PORT = 8000
DASHBOARD_PORT = 8265        # cluster.yaml's head command leaves Ray's default


def deploy_config(repo: str) -> dict:
    """One orchard-tiny replica pinned to the Mac resource, the ingress pinned to the head."""
    return {
        "app_name": APP,
        "api_keys": [API_KEY],
        "http": {"host": "0.0.0.0", "port": HTTP_PORT},
        "capacity": {"heartbeat_interval_s": 0.5, "routing_stats_period_s": 0.5,
                     "queue_timeout_s": 3.0, "actor_resources": {"head": 0.01}},
        "drain_timeout_s": 2,
        "ingress_resources": {"num_cpus": 0, "resources": {"head": 0.01}},
        "models": [{"id": MODEL, "path": os.path.join(repo, "models", "orchard-tiny"),
                    "replicas": 1, "max_num_seqs": 8,
                    "resources": {"num_cpus": 0, "resources": {"mac": 0.01}}}],
    }


class Cluster:
    """HTTP views of the cluster from outside the head."""

    def __init__(self, spec: dict):
        self.spec = spec
        head = spec["nodes"]["head"]["ip"]
        self.dash = httpx.Client(base_url=f"http://{head}:{DASHBOARD_PORT}", timeout=30,
                                 headers={"Authorization": f"Bearer {spec['token']}"})
        self.url = f"http://{head}:{HTTP_PORT}"
        self.api = httpx.Client(base_url=self.url, timeout=30,
                                headers={"Authorization": f"Bearer {API_KEY}"})

    def nodes(self) -> dict[str, dict]:
        """node id -> {ip, state} from the GCS (dead nodes included)."""
        rows = self.dash.get("/api/v0/nodes", params={"limit": 100}).json()["data"]["result"]
        return {n["node_id"]: {"ip": n["node_ip"], "state": n["state"]}
                for n in rows["result"]}

    def alive_ips(self) -> dict[str, str]:
        return {i["ip"]: nid for nid, i in self.nodes().items() if i["state"] == "ALIVE"}

    def actors(self, class_name: str) -> list[dict]:
        rows = self.dash.get("/api/v0/actors", params={
            "limit": 1000, "detail": "true", "filter_keys": "class_name",
            "filter_predicates": "=", "filter_values": class_name}).json()
        return rows["data"]["result"]["result"]

    def replicas(self) -> dict[str, list[dict]]:
        """deployment -> running replicas {replica_id, node_id, node_ip}, from Serve's REST API."""
        apps = self.dash.get("/api/serve/applications/").json()["applications"]
        app = apps.get(APP) or {"deployments": {}}
        return {name: [{"replica_id": r["replica_id"], "node_id": r["node_id"],
                        "node_ip": r["node_ip"]}
                       for r in d["replicas"] if r["state"] == "RUNNING"]
                for name, d in app["deployments"].items()}

    def feed(self) -> dict | None:
        """The model's row of the capacity feed ({} when the feed lists no such model), or
        None when the feed is unavailable."""
        try:
            r = self.api.get("/v1/models/capacity")
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        return next((m for m in r.json()["models"] if m["model_id"] == MODEL), {})

    def metrics(self) -> str:
        return self.api.get("/metrics").text

    def chat(self, max_tokens: int = 4, timeout: float = 30) -> httpx.Response:
        return self.api.post("/v1/chat/completions", timeout=timeout, json={
            "model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]})


def only_if(value, condition):
    """value when condition(value) holds, else None (a wait_until predicate's answer)."""
    return value if value is not None and condition(value) else None


def wait_until(what: str, predicate, timeout_s: float, every_s: float = 0.25):
    """Poll a condition of the cluster until it holds; return its value and the seconds taken."""
    t0 = time.monotonic()
    while True:
        try:
            value = predicate()
        except (httpx.HTTPError, KeyError, ValueError):
            value = None
        if value:
            return value, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def job_submit(spec: dict, cfg_path: str) -> subprocess.CompletedProcess:
    """`ray job submit` exactly as docs/serving.md says, from this (non-head) namespace."""
    repo = spec["repo"]
    env = {"HOME": spec["nodes"]["client"]["home"], "PATH": "/usr/local/bin:/usr/bin:/bin",
           "LANG": "C.UTF-8", "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    head = spec["nodes"]["head"]["ip"]
    for attempt in range(3):
        proc = subprocess.run(
            [os.path.join(repo, ".venv", "bin", "ray"), "job", "submit",
             "--address", f"http://{head}:{DASHBOARD_PORT}", "--working-dir", ".",
             "--", "orchard", "deploy", cfg_path],
            cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        # Ray hashes the working directory twice (name, then upload): a file another process
        # changes in between (a shared checkout) uploads a package the job never finds.
        if "Failed to download runtime_env file package" not in proc.stdout + proc.stderr:
            break
    proc.attempts = attempt + 1
    return proc


def direct_transport(spec: dict, actor: dict) -> dict:
    """Where the capacity actor's direct transport listens and who is connected to it (`ss` in
    the head's namespaces, where the actor's pid is the one Ray reports: the sockets
    themselves, not what the code says about them)."""
    head = in_node(node_from_spec(spec, "head"))
    listen = subprocess.run([*head, "ss", "-Htlnp"], capture_output=True, text=True,
                            check=True).stdout
    # The actor's process also serves Ray's own gRPC port, always on the wildcard address;
    # the direct transport binds the node's address (capacity/actor.py: endpoint()).
    addrs = [line.split()[3] for line in listen.splitlines()
             if f"pid={actor['pid']}," in line
             and line.split()[3].rsplit(":", 1)[0] not in ("*", "0.0.0.0", "[::]")]
    peers = []
    for addr in addrs:
        port = addr.rsplit(":", 1)[1]
        est = subprocess.run([*head, "ss", "-Htn", "state", "established",
                              f"( sport = :{port} )"], capture_output=True, text=True,
                             check=True).stdout
        peers += [line.split()[-1].rsplit(":", 1)[0].removeprefix("[::ffff:").rstrip("]")
                  for line in est.splitlines()]
    return {"listen": addrs, "peers": sorted(set(peers))}


class Load:
    """Mixed load (streams and plain requests) from a few client threads, every request
    recorded with its outcome. A client timeout is a hang: the test fails on any."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 24, timeout_s: float = 60):
        self.url, self.clients, self.max_tokens, self.timeout_s = url, clients, max_tokens, timeout_s
        self.stop = threading.Event()
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)

    def _run(self, i: int) -> None:
        client = httpx.Client(base_url=self.url, timeout=self.timeout_s,
                              headers={"Authorization": f"Bearer {API_KEY}"})
        n = 0
        while not self.stop.is_set():
            stream = (n + i) % 2 == 0
            n += 1
            t0 = time.time()
            rec = self._one(client, stream)
            rec.update(t0=t0, t1=time.time(), stream=stream)
            with self._lock:
                self.records.append(rec)
            if rec["outcome"] in ("refused", "error_event"):
                # A polite client honours Retry-After; here at most 1 s, to see recovery soon.
                self.stop.wait(min(1.0, float(rec.get("retry_after") or 1)))

    def _one(self, client: httpx.Client, stream: bool) -> dict:
        body = {"model": MODEL, "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": stream, "messages": [{"role": "user", "content": "tell me a story"}]}
        try:
            if not stream:
                r = client.post("/v1/chat/completions", json=body)
                return self._status(r, r.status_code == 200)
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return self._status(r, False)
                error, done = None, False
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and '"error"' in line:
                        error = json.loads(line[6:])["error"].get("code")
                out = {"status": 200, "replica": r.headers.get("x-orchard-replica")}
                if error:
                    return {**out, "outcome": "error_event", "error": error, "done": done}
                return {**out, "outcome": "ok" if done else "truncated"}
        except httpx.TimeoutException as e:
            return {"outcome": "hang", "error": type(e).__name__}
        except httpx.HTTPError as e:
            return {"outcome": "transport_error", "error": f"{type(e).__name__}: {e}"}

    @staticmethod
    def _status(r: httpx.Response, ok: bool) -> dict:
        out = {"status": r.status_code, "replica": r.headers.get("x-orchard-replica"),
               "retry_after": r.headers.get("retry-after")}
        if ok:
            return {**out, "outcome": "ok"}
        if r.status_code in (429, 503) and out["retry_after"]:
            return {**out, "outcome": "refused", "error": r.text[:200]}
        return {**out, "outcome": "bad", "error": r.text[:300]}

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.records)


def main(spec: dict, workdir: str) -> dict:
    facts: dict = {}
    c = Cluster(spec)
    worker_ip = spec["nodes"]["worker"]["ip"]
    ips, _ = wait_until("both nodes alive",
                        lambda: only_if(c.alive_ips(), lambda a: len(a) == 2), 60)
    facts["nodes"] = ips
    worker_node = ips[worker_ip]

    # ---- deploy with `ray job submit` from here -------------------------------------------
    cfg_path = os.path.join(workdir, "config.yaml")
    Path(cfg_path).write_text(yaml.safe_dump(deploy_config(spec["repo"])))
    t0 = time.monotonic()
    job = job_submit(spec, cfg_path)
    facts["submit_s"] = round(time.monotonic() - t0, 1)
    facts["submit_rc"] = job.returncode
    facts["submit_attempts"] = job.attempts
    facts["job_tail"] = (job.stdout[-2500:] + job.stderr[-1500:])
    if job.returncode != 0:
        return facts

    r = c.chat()
    facts["chat_status"] = r.status_code
    facts["chat_replica"] = r.headers.get("x-orchard-replica")

    # ---- placement, feed, metrics, direct transport ----------------------------------------
    reps = c.replicas()
    facts["placement"] = {d: [x["node_ip"] for x in rs] for d, rs in reps.items()}
    model_replicas = reps[f"model-{MODEL}"]
    facts["model_replica_ids"] = [x["replica_id"] for x in model_replicas]
    [actor] = [a for a in c.actors("CapacityActor") if a["state"] == "ALIVE"]
    facts["capacity_actor_ip"] = c.nodes()[actor["node_id"]]["ip"]
    feed, _ = wait_until("the capacity feed to list the replica",
                         lambda: only_if(c.feed(), lambda f: f.get("replicas") == 1), 30)
    facts["feed_before"] = feed
    facts["worker_node"] = worker_node
    facts["metrics_replica_info"] = [line for line in c.metrics().splitlines()
                                     if line.startswith("orchard:replica_info")]
    facts["direct_transport"] = direct_transport(spec, actor)

    # ---- the worker's raylet killed under mixed load ---------------------------------------
    load = Load(c.url).start()
    wait_until("load served", lambda: sum(r["outcome"] == "ok" for r in load.snapshot()) >= 6, 60)
    worker = node_from_spec(spec, "worker")
    t_kill = time.time()
    facts["killed_raylet_pid"] = kill_raylet(worker)
    # Detection, each seen from outside as it happens: the GCS marks the node dead; the
    # capacity feed (answering all along) stops listing the worker's slots.
    seen: dict[str, float] = {}

    def detected():
        if "node_dead" not in seen and c.nodes()[worker_node]["state"] == "DEAD":
            seen["node_dead"] = time.time()
        f = c.feed()
        if f is None:
            facts["feed_unavailable_polls"] = facts.get("feed_unavailable_polls", 0) + 1
        elif "feed_dropped" not in seen and worker_node not in f.get("nodes", {}):
            seen["feed_dropped"], facts["feed_after_loss"] = time.time(), f
        return len(seen) == 2
    wait_until("the feed to drop the worker's slots", lambda: detected() or "feed_dropped" in seen,
               120)
    # The worker comes back (its start commands again) while the GCS may still be timing the
    # old raylet out: a Mac that restarted Ray quickly looks like this.
    t_rejoin = time.time()
    facts["rejoin_start_s"] = round(t_rejoin - t_kill, 1)
    restart: dict = {}
    rejoin = threading.Thread(target=lambda: restart.update(s=restart_node(spec, "worker")))
    rejoin.start()
    wait_until("the GCS to mark the old worker node dead", detected, 120)
    for what, t in seen.items():
        facts[f"{what}_after_kill_s"] = round(t - t_kill, 1)
    rejoin.join(150)
    facts["worker_restart_s"] = round(restart["s"], 1)
    new_ips, _ = wait_until("the worker to rejoin", lambda: only_if(
        c.alive_ips(), lambda a: a.get(worker_ip) not in (None, worker_node)), 60)
    facts["new_worker_node"] = new_ips[worker_ip]

    def served_by_new_replica():
        recs = [r for r in load.snapshot() if r["t0"] > t_rejoin and r["outcome"] == "ok"]
        return recs[0] if recs else None
    first_ok, _ = wait_until("a request served after the rejoin", served_by_new_replica, 180)
    facts["served_again_after_kill_s"] = round(first_ok["t1"] - t_kill, 1)
    facts["served_again_after_rejoin_s"] = round(first_ok["t1"] - t_rejoin, 1)
    t_served = time.time()
    wait_until("a streak of served requests", lambda: sum(
        r["outcome"] == "ok" for r in load.snapshot() if r["t0"] >= t_served) >= 6, 60)
    load.finish()

    recs = load.snapshot()
    facts["outcomes"] = {}
    for r in recs:
        facts["outcomes"][r["outcome"]] = facts["outcomes"].get(r["outcome"], 0) + 1
    facts["not_ok"] = [{k: r.get(k) for k in ("outcome", "status", "error", "retry_after",
                                              "stream")} | {"at_s": round(r["t0"] - t_kill, 1)}
                       for r in recs if r["outcome"] != "ok"][:40]
    facts["first_failure_after_kill_s"] = min(
        (round(r["t1"] - t_kill, 2) for r in recs if r["outcome"] != "ok" and r["t1"] > t_kill),
        default=None)
    longest = max(recs, key=lambda r: r["t1"] - r["t0"])
    facts["longest_request"] = {"s": round(longest["t1"] - longest["t0"], 1),
                                "at_s": round(longest["t0"] - t_kill, 1),
                                **{k: longest.get(k) for k in ("outcome", "status", "stream")}}
    reps_after = c.replicas()
    facts["placement_after"] = {d: [x["node_ip"] for x in rs] for d, rs in reps_after.items()}
    facts["model_replica_ids_after"] = [x["replica_id"] for x in reps_after[f"model-{MODEL}"]]
    facts["replicas_served_after"] = sorted({r["replica"] for r in recs
                                             if r["outcome"] == "ok" and r["t0"] > t_served})
    feed_back, _ = wait_until("the feed to list the new replica",
                              lambda: only_if(c.feed(), lambda f: f.get("replicas") == 1), 30)
    facts["feed_after_rejoin"] = feed_back
    return facts


def report_facts(scenario) -> None:
    """A scenario module's entry point: run `scenario(config, repo, facts)` with the command
    line's arguments and print `FACTS {json}` whatever happens (an exception is reported in the
    facts, and the test fails on it), so the facts gathered before a failure still reach it."""
    found: dict = {}
    try:
        scenario(json.loads(sys.argv[1]), sys.argv[2], found)
    except Exception as e:  # noqa: BLE001 - reported in the facts, the test fails on it
        found["error"] = f"{type(e).__name__}: {e}"
    print("FACTS " + json.dumps(found), flush=True)


if __name__ == "__main__":
    print("FACTS " + json.dumps(main(json.loads(sys.argv[1]), sys.argv[2])), flush=True)
