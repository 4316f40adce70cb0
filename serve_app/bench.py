"""TTFT overhead of the serving path over the in-process engine, at light load.

    python -m serve_app.bench [--model DIR] [--requests 40] [--out result.json]

Three paths serve the same request (chat template, greedy, `--max-tokens` tokens), one request
at a time (light load), interleaved round by round after a warm-up:
  engine   Engine.generate in this process: submit -> first delta with a token
  http     the same FastAPI ingress and ModelServer in this process (uvicorn, no Ray)
  serve    the full path: HTTP -> Serve proxy -> ingress -> capacity hold -> replica -> engine
For HTTP, TTFT is request sent -> first SSE event that carries content (iterating lines).
Run with OpenBLAS preloaded (`python -m engine.platform exec ...`); set RAY_TMPDIR to keep the
bench's Ray apart from other Ray users on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import httpx

from serve_app.config import DEFAULT_MODEL_DIR, parse_config

PROMPT = [{"role": "user", "content": "Write one short sentence about apple orchards."}]


def summary(samples_s: list[float]) -> dict:
    ms = sorted(s * 1000 for s in samples_s)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2), "mean_ms": round(statistics.fmean(ms), 2),
            "min_ms": round(ms[0], 2)}


class EnginePath:
    """Engine.generate in this process: submit -> first delta with a token."""

    def __init__(self, model: str, max_tokens: int):
        from engine.config import EngineConfig
        from engine.loop import Engine
        from serve_app.tokens import chat_prompt_ids

        self.engine = Engine(EngineConfig(model=model))
        self.ids = chat_prompt_ids(self.engine.tokenizer, PROMPT)
        self.max_tokens = max_tokens
        self.loop = asyncio.new_event_loop()
        self.i = 0

    def ttft(self) -> float:
        from engine.request import GenerationRequest
        from engine.sampling import SamplingParams

        self.i += 1
        req = GenerationRequest(f"bench-{self.i}", self.ids, SamplingParams(
            temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True))

        async def run() -> float:
            t0 = time.perf_counter()
            first = None
            async for d in self.engine.generate(req):
                if first is None and d.token_ids:
                    first = time.perf_counter() - t0
            return first

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.engine.shutdown(drain_timeout_s=5)
        self.loop.close()


def http_ttft(client: httpx.Client, model_id: str, max_tokens: int) -> float:
    body = {"model": model_id, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line \
                    and '"content":""' not in line:
                first = time.perf_counter() - t0
    return first


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HTTPInProcessPath:
    """The FastAPI ingress and a ModelServer in this process behind uvicorn (no Ray)."""

    def __init__(self, model: str, max_tokens: int):
        import uvicorn

        from serve_app.app import build_local_app

        app, self.servers = build_local_app(parse_config({"models": [{"id": "bench",
                                                                      "path": model}]}))
        port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        self.max_tokens = max_tokens

    def ttft(self) -> float:
        return http_ttft(self.client, "bench", self.max_tokens)

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join()
        for s in self.servers.values():
            s.shutdown()


class ServePath:
    """HTTP -> Serve proxy -> ingress -> capacity hold -> replica -> engine (a local Ray)."""

    def __init__(self, model: str, max_tokens: int):
        import ray
        from ray import serve

        from capacity.actor import get_or_create_actor
        from engine.platform import openblas_env
        from serve_app.app import build_app

        port = _free_port()
        cfg = parse_config({"app_name": "bench", "http": {"port": port},
                            "capacity": {"namespace": "orchard-bench", "snapshot_path": ""},
                            "models": [{"id": "bench", "path": model,
                                        "resources": {"num_cpus": 0}}]})
        ray.init(num_cpus=2, include_dashboard=False, namespace="orchard-bench",
                 log_to_driver=False,
                 runtime_env={"env_vars": {**openblas_env(), "PYTHONPATH": os.getcwd()}})
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.actor = get_or_create_actor(namespace="orchard-bench", snapshot_path="")
        serve.run(build_app(cfg), name="bench", route_prefix="/")
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        self.max_tokens = max_tokens

    def ttft(self) -> float:
        return http_ttft(self.client, "bench", self.max_tokens)

    def close(self) -> None:
        import ray
        from ray import serve

        self.client.close()
        serve.shutdown()
        ray.kill(self.actor)
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve_app.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    result = {"model": args.model, "requests": args.requests, "max_tokens": args.max_tokens,
              "load_avg_before": os.getloadavg()[0]}
    paths = {}
    try:
        for name, cls in (("serve", ServePath), ("http", HTTPInProcessPath),
                          ("engine", EnginePath)):
            paths[name] = cls(args.model, args.max_tokens)
        samples: dict[str, list[float]] = {name: [] for name in paths}
        names = list(paths)
        # Interleaved, rotating order: every path sees the same (shared, noisy) machine.
        for i in range(args.warmup + args.requests):
            for name in names[i % 3:] + names[:i % 3]:
                t = paths[name].ttft()
                if i >= args.warmup:
                    samples[name].append(t)
    finally:
        for path in paths.values():
            path.close()
    for name in ("engine", "http", "serve"):
        result[name] = summary(samples[name])
    result["load_avg_after"] = os.getloadavg()[0]
    # Paired differences (same round) are robust to load drift between rounds.
    result["overhead_ms"] = {
        f"{name}_over_engine": {
            "p50_of_paired": round(1000 * statistics.median(
                a - b for a, b in zip(samples[name], samples["engine"])), 2),
            "p50_difference": round(result[name]["p50_ms"] - result["engine"]["p50_ms"], 2),
            "min_difference": round(result[name]["min_ms"] - result["engine"]["min_ms"], 2)}
        for name in ("http", "serve")}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
