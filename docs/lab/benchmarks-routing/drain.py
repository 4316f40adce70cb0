"""Drain during a multi-turn chat: TTFT of a moved conversation's next turn, handed off vs
recomputed (docs/lab/benchmarks-routing.md, "Drain"). Starts its own local Ray + Serve.

    python -m engine.platform exec python docs/lab/benchmarks-routing/drain.py --out OUT.json

1. Deploy SmolLM2 with 2 replicas (prefix caching on, as by default).
2. Chat: C conversations (a ~250-word system document each, 2 tenants) run 3 turns, all
   conversations at once, so both replicas hold some.
3. Drain during the chat: every conversation sends turn 4 and, while those stream, the app is
   scaled down to 1 replica (same deployment versions: `pinned`): Serve stops routing to one
   replica, waits for its requests, and calls its destructor, which hands its prefix cache to
   the handoff store (serve_app/handoff.py). Turn 4 failures are counted.
4. Once the survivor imported the export, each conversation sends turn 5, and the identical
   request under a third API key (a tenant with nothing cached: what an abrupt death leaves, a
   full prefill). The two run one after the other, alternating which goes first, so both see
   the same box. A conversation whose last turn before the drain ran on the drained replica
   "moved"; the medians compare moved turns with their recomputes.
Writes one JSON: per-request rows, the handoff store's events, and medians.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
MODEL = "smollm2"
KEYS = ["tenant-a-key", "tenant-b-key", "tenant-c-key"]   # a, b chat; c is the recompute
WORDS = ("ledger orchard river copper lantern meadow harbor violet granite thistle beacon "
         "saffron willow quartz falcon ember cedar tundra").split()


def system_doc(rng: random.Random, n: int = 250) -> str:
    return "Keep these notes: " + " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def stream_turn(base: str, key: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn: TTFT (first content), text, usage (with cached tokens)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, text, usage, error, replica = time.perf_counter(), None, [], None, None, None
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            replica = r.headers.get("x-orchard-replica")
            if r.status_code != 200:
                return {"error": f"{r.status_code} {r.read()[:200]!r}", "replica": replica}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    error = ev["error"]
                for c in ev.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(piece)
                usage = ev.get("usage") or usage
    except httpx.HTTPError as e:
        error = repr(e)
    return {"ttft_s": ttft, "text": "".join(text), "error": error, "replica": replica,
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get(
                "cached_tokens"), "e2e_s": time.perf_counter() - t0}


def config(port: int, namespace: str, replicas: int) -> dict:
    return {"app_name": "orchard-drain", "api_keys": KEYS,
            "http": {"host": "127.0.0.1", "port": port},
            "capacity": {"namespace": namespace, "snapshot_path": "", "ttft_objective_s": None},
            "drain_timeout_s": 30,
            "models": [{"id": MODEL, "path": str(REPO / "models" / "smollm2-135m"),
                        "replicas": replicas, "kv_budget_bytes": 805306368,
                        "resources": {"num_cpus": 0}}]}


def pinned(app):
    """The app with fixed deployment versions, so that deploying it again with fewer replicas is
    a scale-down (Serve drains only the replica it removes) and not a redeploy that replaces
    every replica and the ingress (which cuts the streams running through the old ingress)."""
    for a in (app, *app._bound_deployment.init_args[1].values()):
        a._bound_deployment._version = "drain-bench"
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redeploy", action="store_true",
                    help="step 3 redeploys (new versions: every replica and the ingress are "
                    "replaced) instead of scaling down")
    args = ap.parse_args()

    import ray
    from ray import serve

    from capacity.actor import get_or_create_actor
    from engine.platform import openblas_env
    from serve_app.app import build_app
    from serve_app.config import parse_config
    from serve_app.launch import LOCAL_RAY_SYSTEM_CONFIG, SERVE_START_ENV, free_port

    for k, v in SERVE_START_ENV.items():
        os.environ.setdefault(k, v)
    namespace = f"orchard-drain-{os.getpid()}"
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace=namespace,
             runtime_env={"env_vars": {**openblas_env(), "PYTHONPATH": str(REPO)}},
             _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    get_or_create_actor(namespace=namespace, snapshot_path="")
    serve.run(pinned(build_app(parse_config(config(port, namespace, 2)))), name="orchard-drain",
              route_prefix="/")
    base = f"http://127.0.0.1:{port}"

    rng = random.Random(args.seed)
    chats = [{"key": KEYS[i % 2], "messages": [{"role": "system", "content": system_doc(rng)}]}
             for i in range(args.conversations)]
    rows: list[dict] = []

    def ask(n: int) -> str:
        return f"Turn {n}: add a note about {rng.choice(WORDS)} and {rng.choice(WORDS)}."

    def turn(i: int, n: int, key: str | None = None, keep: bool = True,
             text: str | None = None) -> dict:
        c = chats[i]
        msgs = c["messages"] + [{"role": "user", "content": text or ask(n)}]
        got = stream_turn(base, key or c["key"], msgs, args.max_tokens)
        row = {"conversation": i, "turn": n, "tenant": key or c["key"], **got}
        row.pop("text")
        rows.append(row)
        if keep and got["error"] is None:
            c["messages"] = msgs + [{"role": "assistant", "content": got["text"]}]
        return got

    def all_at_once(n: int, stagger_s: float = 0.0) -> None:
        ts = [threading.Thread(target=turn, args=(i, n)) for i in range(len(chats))]
        for t in ts:
            t.start()
            time.sleep(stagger_s)   # pacing: a busy replica sends the next opening elsewhere
        for t in ts:
            t.join()

    all_at_once(1, stagger_s=1.0)
    for n in (2, 3):
        all_at_once(n)
    # Turn 4 streams while the app is redeployed to 1 replica (both old replicas drain).
    t4 = threading.Thread(target=all_at_once, args=(4,))
    t4.start()
    time.sleep(0.5)   # the bench's own pacing: turn 4 is under way when the redeploy starts
    t_drain = time.perf_counter()
    app = build_app(parse_config(config(port, namespace, 1)))
    serve.run(app if args.redeploy else pinned(app), name="orchard-drain", route_prefix="/")
    t4.join()
    store = ray.get_actor("handoff", namespace=namespace)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        events = ray.get(store.events.remote())
        exported = {e["id"] for e in events if e["event"] == "exported"}
        imported = {e["id"] for e in events if e["event"] == "imported"}
        if exported and exported <= imported:
            break
        time.sleep(0.5)
    t_handed = time.perf_counter()
    for i in range(len(chats)):
        # Handed off vs recomputed (a tenant with nothing cached): the same prompt, one after
        # the other, alternating which goes first.
        text = ask(5)
        for key in ([None, KEYS[2]] if i % 2 == 0 else [KEYS[2], None]):
            turn(i, 5, key=key, keep=False, text=text)
    drained = {e["from"] for e in events if e["event"] == "exported"}
    home = {}   # conversation -> the replica of its last turn before the drain
    for r in sorted(rows, key=lambda r: r["turn"]):
        if r["turn"] <= 4 and not r["error"]:
            home[r["conversation"]] = r["replica"]
    moved_ids = {i for i, rid in home.items() if rid in drained}
    moved = [r for r in rows if r["turn"] == 5 and r["tenant"] != KEYS[2]
             and r["conversation"] in moved_ids]
    stayed = [r for r in rows if r["turn"] == 5 and r["tenant"] != KEYS[2]
              and r["conversation"] not in moved_ids]
    recomputed = [r for r in rows if r["turn"] == 5 and r["tenant"] == KEYS[2]
                  and r["conversation"] in moved_ids]

    def med(rs, k):
        vals = [r[k] for r in rs if r.get(k) is not None]
        return statistics.median(vals) if vals else None
    summary = {
        "conversations": len(chats), "max_tokens": args.max_tokens,
        "step3": "redeploy" if args.redeploy else "scale-down",
        "drained_replicas": sorted(drained), "moved_conversations": sorted(moved_ids),
        "stayed_ttft_p50_s": med(stayed, "ttft_s"),
        "turn4_during_drain_failed": sum(1 for r in rows if r["turn"] == 4 and r["error"]),
        "failed_total": sum(1 for r in rows if r["error"]),
        "drain_to_handed_off_s": t_handed - t_drain,
        "moved_ttft_p50_s": med(moved, "ttft_s"), "recompute_ttft_p50_s": med(recomputed, "ttft_s"),
        "moved_cached_share": sum(r["cached_tokens"] or 0 for r in moved)
        / max(1, sum(r["prompt_tokens"] or 0 for r in moved)),
        "recompute_cached_tokens": sum(r["cached_tokens"] or 0 for r in recomputed),
        "prompt_tokens_p50": med(moved, "prompt_tokens"),
    }
    if summary["moved_ttft_p50_s"] and summary["recompute_ttft_p50_s"]:
        summary["ttft_ratio"] = summary["moved_ttft_p50_s"] / summary["recompute_ttft_p50_s"]
    events = [{k: v for k, v in e.items()} for e in ray.get(store.events.remote())]
    Path(args.out).write_text(json.dumps({"summary": summary, "handoff_events": events,
                                          "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
