"""TTFT and per-token overhead of the serving path over the in-process engine, at light load.

    python -m bench.serve_path [--model smollm2|DIR|FILE.gguf] [--requests 40] [--out result.json]

Three paths serve the same request (chat template, greedy, `--max-tokens` tokens), one request
at a time (light load), interleaved round by round after a warm-up:
  engine   Engine.generate in this process: submit -> first delta with a token
  http     the same FastAPI ingress and ModelServer in this process (uvicorn, no Ray)
  serve    the full path: HTTP -> ingress replica (Serve direct ingress, as `orchard serve` runs
           it; --proxy: through Serve's HTTP proxy first) -> capacity hold -> replica -> engine
For HTTP, TTFT is request sent -> first SSE event that carries content (iterating lines).
Per-token time (TPOT) is first content -> last content over max_tokens - 1 (EOS is ignored, so
every path generates exactly --max-tokens): with one stream, what the serving path adds to each
token once the engine streams (give --max-tokens 32 or more for it to mean something).
Run with OpenBLAS preloaded (`python -m engine.platform exec ...`); set RAY_TMPDIR to keep the
bench's Ray apart from other Ray users on the machine.

  --trace                  per-hop timestamps (ORCHARD_TRACE=1 in every process): median time
                           per stage of the HTTP paths (client -> ingress -> router -> replica ->
                           engine -> back), from the x-orchard-trace header
  --variant NAME:K=V,...   another Serve app on the same cluster whose replicas get these env
                           vars (config replica_env), measured interleaved with the others
  --cluster-env K=V        set for the whole local Ray cluster (proxy and controller too)
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

from engine.model.names import MODEL_HELP, model_arg
from serve_app.calls import TRACE_ENV
from serve_app.launch import LOCAL_RAY_SYSTEM_CONFIG
from serve_app.config import parse_config

PROMPT = [{"role": "user", "content": "Write one short sentence about apple orchards."}]


def summary(samples_s: list[float]) -> dict:
    ms = sorted(s * 1000 for s in samples_s)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2), "mean_ms": round(statistics.fmean(ms), 2),
            "min_ms": round(ms[0], 2)}


# Every path gets the same small KV pool: three engines (in process, behind HTTP, in the Ray
# replica) each sizing its pool from the box's memory would together take more than the box
# has, and a one-request bench needs a few pages.
BENCH_KV_BYTES = 256 << 20


class EnginePath:
    """Engine.generate in this process: submit -> first delta with a token."""

    def __init__(self, model: str, max_tokens: int):
        from engine.config import EngineConfig
        from engine import Engine
        from serve_app.tokens import chat_prompt_ids

        self.engine = Engine(EngineConfig(model=model, kv_budget_bytes=BENCH_KV_BYTES))
        self.ids = chat_prompt_ids(self.engine.tokenizer, PROMPT)
        self.max_tokens = max_tokens
        self.loop = asyncio.new_event_loop()
        self.i = 0

    def measure(self) -> tuple[float, float | None, None]:
        from engine.request import GenerationRequest
        from engine.sampling.params import SamplingParams

        self.i += 1
        req = GenerationRequest(f"bench-{self.i}", self.ids, SamplingParams(
            temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True))

        async def run() -> tuple[float, float]:
            t0 = time.perf_counter()
            first = last = None
            async for d in self.engine.generate(req):
                if d.token_ids:
                    last = time.perf_counter() - t0
                    first = last if first is None else first
            return first, last

        first, last = self.loop.run_until_complete(run())
        return first, per_token(first, last, self.max_tokens), None

    def close(self) -> None:
        self.engine.shutdown(drain_timeout_s=5)
        self.loop.close()


# Hops in path order, as stamped by serve_app (ingress, router, replica) and the bench client.
STAGES = ("client_send", "ingress_in", "ingress_call_built", "router_in", "router_held",
          "router_chosen", "replica_in", "replica_first_delta", "ingress_first_item",
          "client_first")


def per_token(first: float, last: float, max_tokens: int) -> float | None:
    """Seconds per token after the first (None when only one token was asked for)."""
    return (last - first) / (max_tokens - 1) if max_tokens > 1 else None


def http_measure(client: httpx.Client, model_id: str, max_tokens: int,
                 prefix: str = "") -> tuple[float, float | None, dict | None]:
    body = {"model": model_id, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    wall0 = time.time()
    t0 = time.perf_counter()
    first, last, trace = None, None, None
    with client.stream("POST", prefix + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line \
                    and '"content":""' not in line:
                last = time.perf_counter() - t0
                if first is None:
                    first = last
                    if "x-orchard-trace" in r.headers:
                        trace = {**json.loads(r.headers["x-orchard-trace"]),
                                 "client_send": wall0, "client_first": wall0 + first}
    return first, per_token(first, last, max_tokens), trace


def stage_summary(traces: list[dict]) -> dict:
    """Median ms per stage (consecutive hops present in every trace of the path)."""
    present = [k for k in STAGES if traces and all(k in t for t in traces)]
    out = {}
    for a, b in zip(present, present[1:]):
        out[f"{a}->{b}"] = round(1000 * statistics.median(t[b] - t[a] for t in traces), 2)
    engine = [t["engine_ttft_s"] for t in traces if t.get("engine_ttft_s") is not None]
    if engine:   # the engine's own TTFT inside replica_in->replica_first_delta
        out["engine_ttft (replica's engine)"] = round(1000 * statistics.median(engine), 2)
    return out


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

        app, self.servers = build_local_app(parse_config({"models": [{
            "id": "bench", "path": model, "kv_budget_bytes": BENCH_KV_BYTES}]}))
        port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        self.max_tokens = max_tokens

    def measure(self) -> tuple[float, float | None, dict | None]:
        return http_measure(self.client, "bench", self.max_tokens)

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join()
        for s in self.servers.values():
            s.shutdown()


def _app_config(port: int, model: str, model_id: str, replica_env: dict[str, str]):
    return parse_config({"app_name": "bench", "http": {"port": port},
                         "capacity": {"namespace": "orchard-bench", "snapshot_path": ""},
                         "replica_env": replica_env,
                         "models": [{"id": model_id, "path": model,
                                     "kv_budget_bytes": BENCH_KV_BYTES,
                                     "resources": {"num_cpus": 0}}]})


class ServeCluster:
    """One local Ray with Serve: the base app at / and one app per variant at /<name>.

    With direct ingress each app's ingress replica serves HTTP itself on a port of its own
    (from `direct_port` up); requests then skip the Serve proxy.
    """

    def __init__(self, model: str, cluster_env: dict[str, str], direct_ingress: bool = False,
                 worker_niceness: int = 0):
        import ray
        from ray import serve

        from capacity.actor import get_or_create_actor
        from engine.platform import openblas_env

        self.port = _free_port()
        self.model = model
        self.direct_port = None
        if direct_ingress:
            from serve_app.launch import direct_ingress_env

            self.direct_port = _free_port()
            cluster_env = {**direct_ingress_env(self.direct_port, span=16), **cluster_env}
        # The raylet (and so the proxy and controller) inherits the driver's environment.
        os.environ.update(cluster_env)
        ray.init(num_cpus=2, include_dashboard=False, namespace="orchard-bench",
                 log_to_driver=False,
                 _system_config={**LOCAL_RAY_SYSTEM_CONFIG, "worker_niceness": worker_niceness},
                 runtime_env={"env_vars": {**openblas_env(), "PYTHONPATH": os.getcwd(),
                                           **cluster_env}})
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.actor = get_or_create_actor(namespace="orchard-bench", snapshot_path="")
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def deploy(self, name: str, replica_env: dict[str, str]) -> None:
        from ray import serve

        from serve_app.app import build_app

        model_id = "bench" if name == "serve" else f"bench-{name}"
        prefix = "/" if name == "serve" else f"/{name}"
        serve.run(build_app(_app_config(self.port, self.model, model_id, replica_env)),
                  name=model_id, route_prefix=prefix)
        if self.direct_port is None:
            return self.client, prefix.rstrip("/")
        # Each ingress replica listens on its own port: find the one serving this app.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for port in range(self.direct_port, self.direct_port + 16):
                for path_prefix in ("", prefix.rstrip("/")):
                    try:
                        r = httpx.get(f"http://127.0.0.1:{port}{path_prefix}/v1/models",
                                      timeout=5)
                        if model_id in {m["id"] for m in r.json().get("data", [])}:
                            return (httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                                 timeout=60), path_prefix)
                    except (httpx.HTTPError, ValueError, AttributeError):
                        pass
            time.sleep(0.5)
        raise RuntimeError(f"no direct-ingress port serves {model_id}")

    def close(self) -> None:
        import ray
        from ray import serve

        self.client.close()
        serve.shutdown()
        ray.kill(self.actor)
        ray.shutdown()


class ServePath:
    """HTTP -> Serve proxy -> ingress -> capacity hold -> replica -> engine (a local Ray)."""

    def __init__(self, cluster: ServeCluster, name: str, replica_env: dict[str, str],
                 max_tokens: int):
        self.client, self.prefix = cluster.deploy(name, replica_env)
        self.cluster, self.max_tokens = cluster, max_tokens
        self.model_id = "bench" if name == "serve" else f"bench-{name}"

    def measure(self) -> tuple[float, float | None, dict | None]:
        return http_measure(self.client, self.model_id, self.max_tokens, self.prefix)

    def close(self) -> None:
        if self.client is not self.cluster.client:
            self.client.close()


def _env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        for pair in filter(None, item.split(",")):
            k, sep, v = pair.partition("=")
            if not sep:
                raise SystemExit(f"expected K=V, got {pair!r}")
            out[k.strip()] = v.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="orchard-tiny", type=model_arg,
                   help=MODEL_HELP + " (default: orchard-tiny)")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--trace", action="store_true", help="per-hop stage timings (debug)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,...",
                   help="another Serve app whose replicas get these env vars (repeatable)")
    p.add_argument("--cluster-env", action="append", default=[], metavar="K=V",
                   help="env var for the whole local Ray cluster (repeatable)")
    p.add_argument("--proxy", action="store_true",
                   help="through Serve's HTTP proxy, as before (default: direct ingress, "
                   "as `orchard serve` runs)")
    p.add_argument("--worker-niceness", type=int, default=LOCAL_RAY_SYSTEM_CONFIG[
                       "worker_niceness"],
                   help="niceness of the local Ray's workers (default: %(default)s, as `orchard "
                   "serve` starts them; Ray's own default is 15)")
    args = p.parse_args(argv)
    if args.trace:
        os.environ[TRACE_ENV] = "1"
    cluster_env = _env_pairs(args.cluster_env)
    if args.trace:
        cluster_env[TRACE_ENV] = "1"
    variants = {"serve": {}}
    for v in args.variant:
        name, _, pairs = v.partition(":")
        variants[f"serve-{name}"] = _env_pairs([pairs])
    result = {"model": args.model, "requests": args.requests, "max_tokens": args.max_tokens,
              "cluster_env": cluster_env, "variants": variants,
              "ingress": "proxy" if args.proxy else "direct",
              "worker_niceness": args.worker_niceness,
              "load_avg_before": os.getloadavg()[0]}
    paths, cluster = {}, None
    try:
        cluster = ServeCluster(args.model, cluster_env, direct_ingress=not args.proxy,
                               worker_niceness=args.worker_niceness)
        for name, env in variants.items():
            paths[name] = ServePath(cluster, name, env, args.max_tokens)
        paths["http"] = HTTPInProcessPath(args.model, args.max_tokens)
        paths["engine"] = EnginePath(args.model, args.max_tokens)
        samples: dict[str, list[float]] = {name: [] for name in paths}
        tpots: dict[str, list[float]] = {name: [] for name in paths}
        traces: dict[str, list[dict]] = {name: [] for name in paths}
        names = list(paths)
        # Interleaved, rotating order: every path sees the same (shared, noisy) machine.
        for i in range(args.warmup + args.requests):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t, tpot, trace = paths[name].measure()
                if i >= args.warmup:
                    samples[name].append(t)
                    if tpot is not None:
                        tpots[name].append(tpot)
                    if trace:
                        traces[name].append(trace)
    finally:
        for path in paths.values():
            path.close()
        if cluster is not None:
            cluster.close()
    for name in names:
        result[name] = summary(samples[name])
        if tpots[name]:
            result[name]["tpot"] = summary(tpots[name])
    result["load_avg_after"] = os.getloadavg()[0]
    if tpots["engine"]:
        # Per token, paired by round: what each path adds to every token after the first.
        result["tpot_overhead_ms"] = {
            f"{name}_over_engine": {
                "p50_of_paired": round(1000 * statistics.median(
                    a - b for a, b in zip(tpots[name], tpots["engine"])), 3),
                "ratio_of_p50": round(statistics.median(tpots[name])
                                      / statistics.median(tpots["engine"]), 3)}
            for name in names if name != "engine"}
    # Paired differences (same round) are robust to load drift between rounds.
    result["overhead_ms"] = {
        f"{name}_over_engine": {
            "p50_of_paired": round(1000 * statistics.median(
                a - b for a, b in zip(samples[name], samples["engine"])), 2),
            "p50_difference": round(result[name]["p50_ms"] - result["engine"]["p50_ms"], 2),
            "min_difference": round(result[name]["min_ms"] - result["engine"]["min_ms"], 2)}
        for name in names if name != "engine"}
    for name in names:
        if name.startswith("serve-"):
            result["overhead_ms"][f"{name}_over_serve"] = {"p50_of_paired": round(
                1000 * statistics.median(a - b for a, b in zip(samples[name],
                                                               samples["serve"])), 2)}
    if args.trace:
        result["stages_ms"] = {name: stage_summary(t) for name, t in traces.items() if t}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
