"""A redeploy under a live stream: does the stream end cleanly, and how long does the old ingress
linger after it (docs/lab/benchmarks-routing.md, "Redeploy: the old ingress"). Starts its own
local Ray + Serve.

    python -m engine.platform exec python docs/lab/benchmarks-routing/ingress_redeploy.py \\
        --out OUT.json [--serve-defaults]

1. Deploy SmolLM2, 1 replica.
2. Stream one long reply (--max-tokens, ignore_eos); at its first token, deploy the app again
   (new versions: Serve starts a new ingress and replica, then stops the old ones).
3. Record the stream's outcome, when the old ingress's process was gone, and the same redeploy
   with no stream running.
--serve-defaults deploys the ingress with Serve's own graceful-shutdown settings (20 s budget,
2 s poll), as before this page's change, to measure the before.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
MODEL, KEY, APP = "smollm2", "tenant-a-key", "orchard-redeploy"


def config(port: int, namespace: str, drain_timeout_s: float) -> dict:
    return {"app_name": APP, "api_keys": [KEY], "http": {"host": "127.0.0.1", "port": port},
            "capacity": {"namespace": namespace, "snapshot_path": "", "ttft_objective_s": None},
            "drain_timeout_s": drain_timeout_s,
            "models": [{"id": MODEL, "path": str(REPO / "models" / "smollm2-135m"),
                        "replicas": 1, "kv_budget_bytes": 805306368,
                        "resources": {"num_cpus": 0}}]}


def stream(base: str, max_tokens: int, out: dict, first: threading.Event) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out["start"], out["events"], out["errors"], out["done"] = time.monotonic(), 0, [], False
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["errors"].append(ev["error"])
                    if ev.get("usage"):
                        out["completion_tokens"] = ev["usage"]["completion_tokens"]
                    if any((c.get("delta") or {}).get("content") for c in ev.get("choices") or []):
                        out["events"] += 1
                        first.set()
    except httpx.HTTPError as e:
        out["errors"].append(repr(e))
    out["end"] = time.monotonic()
    first.set()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def redeploy(build, ingress_pid: int) -> tuple[float, dict]:
    """Deploy again; return the deploy call's time and, in seconds from it, when serve.run
    returned and when the old ingress's process was gone."""
    from ray import serve

    t0, seen = time.monotonic(), {}

    def watch():
        # No Ray calls in this thread: serve.run (re)serializes the router class in the main
        # thread, and that is not thread-safe (seen: ValueError from cloudpickle, a hung run).
        while alive(ingress_pid):
            time.sleep(0.1)
        seen["gone_s"] = time.monotonic() - t0

    w = threading.Thread(target=watch)
    w.start()
    serve.run(build(), name=APP, route_prefix="/")
    seen["serve_run_s"] = time.monotonic() - t0
    w.join(600)
    return t0, seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=1200)
    ap.add_argument("--drain-timeout-s", type=float, default=60.0,
                    help="the model replicas' drain: long enough that they never cut the stream")
    ap.add_argument("--serve-defaults", action="store_true")
    args = ap.parse_args()

    import ray
    from ray import serve

    from capacity.actor import get_or_create_actor
    from engine.platform import openblas_env
    from serve_app import app as app_mod
    from serve_app.config import parse_config
    from serve_app.launch import LOCAL_RAY_SYSTEM_CONFIG, SERVE_START_ENV, free_port

    if args.serve_defaults:
        keep = app_mod.ingress_deployment_options
        app_mod.ingress_deployment_options = lambda cfg: {
            k: v for k, v in keep(cfg).items() if not k.startswith("graceful_shutdown")}
    for k, v in SERVE_START_ENV.items():
        os.environ.setdefault(k, v)
    namespace = f"orchard-redeploy-{os.getpid()}"
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace=namespace,
             runtime_env={"env_vars": {**openblas_env(), "PYTHONPATH": str(REPO)}},
             _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    get_or_create_actor(namespace=namespace, snapshot_path="")
    cfg = parse_config(config(port, namespace, args.drain_timeout_s))
    build = lambda: app_mod.build_app(cfg)  # noqa: E731 - a fresh app (new versions) per call
    serve.run(build(), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    pid = lambda: serve.get_app_handle(APP).pid.remote().result()  # noqa: E731

    s, first = {}, threading.Event()
    t = threading.Thread(target=stream, args=(base, args.max_tokens, s, first))
    t.start()
    first.wait(300)
    old = pid()
    t_live, live = redeploy(build, old)
    t.join(600)
    live["stream_end_s"] = s["end"] - t_live
    live["gone_after_stream_end_s"] = live["gone_s"] - live["stream_end_s"]
    _, idle = redeploy(build, pid())
    res = {"serve_defaults": args.serve_defaults, "ingress_options": {
               k: v for k, v in app_mod.ingress_deployment_options(cfg).items()
               if k.startswith("graceful")},
           "max_tokens": args.max_tokens, "drain_timeout_s": args.drain_timeout_s,
           "stream": {"status": s.get("status"), "content_events": s["events"],
                      "completion_tokens": s.get("completion_tokens"), "done": s["done"],
                      "errors": s["errors"], "seconds": round(s["end"] - s["start"], 2)},
           "live_redeploy": {k: round(v, 2) for k, v in live.items()},
           "idle_redeploy": {k: round(v, 2) for k, v in idle.items()}}
    print(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
