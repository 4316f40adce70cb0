"""A redeploy replaces the ingress while a reply streams through the old one: the old ingress
stops only after the stream ended cleanly (every token, then [DONE]), and leaves right after it
(serve_app/app.py's ingress shutdown options; docs/lab/benchmarks-routing.md measures the real
model). Its own Serve app, route prefix and capacity namespace."""
from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from tests.fixtures.chat_app import AUTH
from tests.fixtures.serve import make_config, wait_for, wait_http_ok

pytestmark = pytest.mark.slow

APP, ROUTE, MODEL = "orchard-redeploy", "/redeploy", "tiny-redeploy"
MAX_TOKENS = 1500   # seconds of decoding on the tiny model: the stream outlasts the ingress swap


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def stream(base: str, out: dict, first: threading.Event) -> None:
    """One long streamed reply; records its events' times, errors, usage and whether [DONE]
    came. Talks HTTP only (the test's thread owns every Serve call)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out.update(times=[], errors=[], done=False, usage=None)
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=AUTH,
                          timeout=300) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["errors"].append(ev["error"])
                    out["usage"] = ev.get("usage") or out["usage"]
                    if any((c.get("delta") or {}).get("content") for c in ev.get("choices") or []):
                        out["times"].append(time.monotonic())
                        first.set()
    except httpx.HTTPError as e:
        out["errors"].append(repr(e))
    finally:
        out["end"] = time.monotonic()
        first.set()


def test_a_redeploy_lets_the_old_ingress_finish_its_streams(orchard_url, orchard_config,
                                                            tiny_llama):
    import ray
    from ray import serve

    from capacity.actor import get_or_create_actor
    from serve_app.app import build_app
    from serve_app.config import parse_config

    namespace = f"{APP}-{os.getpid()}"
    raw = make_config(tiny_llama, orchard_config["http"]["port"], namespace)
    # The model replica's drain outlasts the stream even on a loaded box: what is under test is
    # the ingress, which must never be the one to cut a stream its replica still serves.
    raw.update(app_name=APP, drain_timeout_s=60)
    raw["models"][0].update(id=MODEL)
    cfg = parse_config(raw)
    get_or_create_actor(namespace=namespace, snapshot_path="")
    serve.run(build_app(cfg), name=APP, route_prefix=ROUTE)
    base = orchard_url + ROUTE
    wait_http_ok(base + "/health")
    try:
        old_ingress = serve.get_app_handle(APP).pid.remote().result()
        got, first = {}, threading.Event()
        t = threading.Thread(target=stream, args=(base, got, first))
        t.start()
        assert first.wait(120) and got["times"], got

        # New versions of every deployment: Serve starts a new ingress and replica and stops
        # the old ones. Not blocking, so this thread can watch the old ingress drain.
        redeployed = time.monotonic()
        serve._run(build_app(cfg), _blocking=False, name=APP, route_prefix=ROUTE)

        def ingress_stopping() -> bool:
            states = serve.status().applications[APP].deployments["ingress"].replica_states
            return bool(states.get("STOPPING"))
        wait_for(ingress_stopping, 60, "the old ingress to be stopping")
        stopping_seen = time.monotonic()
        streaming_then = "end" not in got
        wait_for(lambda: not alive(old_ingress), 120, "the old ingress to exit")
        gone = time.monotonic()
        t.join(120)

        assert streaming_then, "the stream ended before the old ingress began to stop"
        assert got["status"] == 200 and got["done"] and not got["errors"], got
        assert got["usage"]["completion_tokens"] == MAX_TOKENS, got["usage"]
        print(f"redeploy: old ingress stopping {stopping_seen - redeployed:.2f} s after the "
              f"deploy; stream ended {got['end'] - redeployed:.2f} s after it; old ingress "
              f"gone {gone - got['end']:.2f} s after the stream's end")
        # The new ingress serves.
        wait_http_ok(base + "/health")
        assert serve.get_app_handle(APP).pid.remote().result() != old_ingress
    finally:
        serve.delete(APP)
        for name in ("capacity", "handoff"):
            try:
                ray.kill(ray.get_actor(name, namespace=namespace))
            except ValueError:   # never created
                pass


def test_the_old_ingress_outlives_its_model_replicas_drain(tmp_path):
    """Unit: a stream lasts at most its model replica's shutdown budget; the ingress's budget
    is longer by the time to relay its last events, for any drain_timeout_s."""
    from serve_app.app import ingress_deployment_options, model_shutdown_budget_s
    from serve_app.config import parse_config

    for drain in (0, 5, 30, 300):
        cfg = parse_config(make_config(str(tmp_path), 8000, "ns") | {"drain_timeout_s": drain})
        opts = ingress_deployment_options(cfg)
        assert opts["graceful_shutdown_timeout_s"] > model_shutdown_budget_s(cfg) >= drain
        # It leaves within half a second of its last stream (Serve's default poll is 2 s).
        assert opts["graceful_shutdown_wait_loop_s"] <= 0.5
