"""`orchard`: serve, deploy and inspect Orchard on Ray.

  orchard serve [MODEL|CONFIG]  start (or join) Ray, deploy, wait until healthy, print a startup
                            summary and the URL, block. MODEL: smollm2, orchard-tiny, a model
                            folder, a .gguf file or a Hugging Face id in the local cache;
                            CONFIG: a .yaml/.yml file
  orchard deploy CONFIG     deploy onto a running cluster (e.g. inside `ray job submit`), exit
  orchard status            replicas, formats, budgets and caps of the running service
  orchard loadtest ...      headless Locust run against an endpoint (loadtest.runner)
  orchard bench WHAT ...    benchmarks that print JSON (bench/, loadtest/)
  orchard quality ...       KV-format quality gate against native (quality/)
    (their --model takes smollm2, orchard-tiny, a model folder or a .gguf file:
    engine.model_names)
  orchard import-gguf FILE OUT_DIR   import a llama.cpp/Ollama GGUF into a model folder
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any


def _kv_formats() -> list[str]:
    from capacity.formats import FORMAT_BITS

    return list(FORMAT_BITS)


def _say(msg: str) -> None:
    print(f"[orchard] {msg}", flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchard", description="Serve LLMs on Ray Serve with MLX "
                                "engines and capacity-aware routing.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("serve", help="start or join Ray, deploy, block until Ctrl-C",
                       description="Serve one MODEL with default settings, or a YAML CONFIG "
                       "(default: the embedded models/orchard-tiny).")
    s.add_argument("target", nargs="?", metavar="MODEL|CONFIG",
                   help="a .yaml/.yml config (see config.example.yaml), or one model to serve "
                   "with no config: smollm2 (models/smollm2-135m, from `make real-model`), "
                   "orchard-tiny, a model folder, a .gguf file (imported once into a cache "
                   "folder) or a Hugging Face id (org/name) already in the local cache")
    s.add_argument("--model", default=None, metavar="MODEL",
                   help="the same as giving MODEL positionally (kept for older scripts)")
    s.add_argument("--model-id", default=None,
                   help="the id clients use for MODEL (default: the folder/file/repo name)")
    s.add_argument("--kv-format", default=None, metavar="FORMAT",
                   help="KV cache format for MODEL: " + ", ".join(_kv_formats())
                   + " (default: native)")
    s.add_argument("--address", default=None,
                   help="Ray address to join (default: start a local Ray)")
    s.add_argument("--host", default=None, help="HTTP host (overrides the config)")
    s.add_argument("--port", type=int, default=None, help="HTTP port (overrides the config)")
    s.add_argument("--timeout", type=float, default=600, help="seconds to wait for healthy")
    d = sub.add_parser("deploy", help="deploy CONFIG onto a running Ray cluster and exit",
                       description="Deploy onto the cluster at --address (default: auto, i.e. "
                       "RAY_ADDRESS or the local head; inside `ray job submit` the job's).")
    d.add_argument("config", help="YAML config")
    d.add_argument("--address", default="auto")
    d.add_argument("--timeout", type=float, default=600, help="seconds to wait for healthy")
    st = sub.add_parser("status", help="show replicas, formats, budgets and caps")
    st.add_argument("--address", default="auto")
    st.add_argument("--app", default="orchard", help="Serve application name")
    st.add_argument("--namespace", default="orchard", help="capacity actor namespace")
    lt = sub.add_parser("loadtest", help="headless Locust run (see `orchard loadtest --help`)",
                        add_help=False)
    lt.add_argument("rest", nargs=argparse.REMAINDER)
    b = sub.add_parser("bench", help="benchmarks printing JSON: " + ", ".join(BENCHES),
                       description="Run one benchmark; arguments after WHAT go to it "
                       "(`orchard bench WHAT --help`). Their --model takes smollm2 "
                       "(models/smollm2-135m, from `make real-model`), orchard-tiny, a model "
                       "folder or a .gguf file.")
    b.add_argument("what", choices=sorted(BENCHES))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    q = sub.add_parser("quality", help="KV-format quality gate (see `orchard quality --help`)",
                       add_help=False)
    q.add_argument("rest", nargs=argparse.REMAINDER)
    g = sub.add_parser(
        "import-gguf", help="import a GGUF file (llama.cpp/Ollama) into a model folder",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write OUT_DIR as a model folder that mlx-lm and Orchard load: config.json, "
        "model.safetensors, tokenizer.json, tokenizer_config.json (the GGUF's chat template, "
        "bos/eos), generation_config.json.",
        epilog="architectures: llama family, gemma3 (others are refused, naming the arch)\n"
        "tensor types: F32 F16 BF16 Q8_0 Q4_0 Q4_1 (exact), K-quants and others through the "
        "gguf package\n"
        "example: orchard import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2 "
        "--dtype float32\nsee docs/models.md")
    g.add_argument("file", help="the .gguf file")
    g.add_argument("out_dir", help="model folder to write (must not exist or be empty)")
    g.add_argument("--dtype", default="float32",
                   choices=["float32", "bfloat16", "float16", "keep"],
                   help="float32/bfloat16/float16 dequantize every weight; keep keeps "
                   "MLX-quantized weights (Q8_0/Q4_0/Q4_1 exactly, other types re-quantized) "
                   "with per-layer bits and group size in config.json (default: float32)")
    g.add_argument("--force", action="store_true", help="replace OUT_DIR if it is not empty")
    return p


# Subcommands that hand their arguments to a module's main(argv); imported only when used.
BENCHES = {
    "engine": "bench.engine",              # paged engine vs mlx-lm, OpenBLAS on/off
    "kv": "bench.kv",                      # KV formats: bytes, capacity, prefill/decode ratios
    "attention": "bench.attention",        # packed-history attention variants vs native
    "sampling": "bench.sampling",          # the batched sampler's cost per step
    "constrained": "bench.constrained",    # structured output: llguidance vs outlines-core
    "capacity": "bench.capacity",          # capacity actor round trips, memory per identity
    "serve": "loadtest.bench_serve",       # Orchard vs mlx_lm.server, rate sweeps
    "serve-path": "bench.serve_path",      # TTFT overhead of the HTTP/Serve path
    "memory": "loadtest.bench_memory",     # Orchard vs mlx_lm.server under one memory limit
}


def _delegate(module: str, argv: list[str]) -> int:
    import importlib

    return importlib.import_module(module).main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "loadtest":
        # Locust must be imported before anything that imports requests/urllib3/ray.
        return _delegate("loadtest.runner", argv[1:])
    from engine.platform import ensure_openblas_preloaded

    # MLX in this process (and its Ray workers) needs OpenBLAS preloaded on Linux CPUs.
    ensure_openblas_preloaded()
    if argv and argv[0] == "quality":
        # Every argument, --help included, belongs to the gate's own parser.
        return _delegate("quality.gate", argv[1:])
    args = _parser().parse_args(argv)
    from serve_app.config import ConfigError

    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "deploy":
            return cmd_deploy(args)
        if args.command == "bench":
            return _delegate(BENCHES[args.what], args.rest)
        if args.command == "import-gguf":
            return cmd_import_gguf(args)
        return cmd_status(args)
    except ConfigError as e:
        print(f"orchard: config error:\n{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def is_config_path(target: str) -> bool:
    """A positional `orchard serve` argument is a config when it names a YAML file."""
    return target.lower().endswith((".yaml", ".yml"))


def _serve_config(args):
    """The config `orchard serve` deploys: a YAML file, one model (positional or --model), or
    the embedded default. Everything is resolved here, before Ray starts, so bad input exits 2
    having touched nothing."""
    from serve_app.config import ConfigError

    target, model = args.target, args.model
    if target is not None and model is not None:
        raise ConfigError("give MODEL|CONFIG or --model, not both")
    if target is not None and is_config_path(target):
        if args.kv_format is not None or args.model_id is not None:
            raise ConfigError("--kv-format and --model-id apply to one MODEL; with a config, "
                              "set kv_format / id in the config")
        return _load(target)
    model = model if model is not None else target
    if model is None and (args.kv_format is not None or args.model_id is not None):
        model = "orchard-tiny"    # the embedded default, with the flags applied
    return _load(None, model, args.model_id, args.kv_format)


def _load(path: str | None, model: str | None = None, model_id: str | None = None,
          kv_format: str | None = None):
    from pathlib import Path

    from serve_app.config import ConfigError, default_config, load_config, parse_config

    if model is not None:
        if path is not None:
            raise ConfigError("give either CONFIG or --model, not both")
        from engine.model.names import ModelNameError, known_name, looks_like_hub_id, \
            resolve_model

        spec = model
        try:
            # One resolution for the whole service: the engine and the ingress (tokenizer
            # files) load this same folder, and a hub id never reaches the network.
            folder = resolve_model(model)
        except ModelNameError as e:
            raise ConfigError(str(e)) from None
        if model_id is None:
            if known_name(spec) is not None:      # a short name is served as its folder name
                model_id = Path(folder).name
            elif looks_like_hub_id(spec) and not Path(spec).exists():
                model_id = spec.split("/", 1)[1]  # ids may not contain '/'
            else:
                model_id = Path(spec).name.removesuffix(".gguf").removesuffix(".GGUF")
        entry = {"id": model_id, "path": folder}
        if kv_format is not None:
            from capacity.formats import KVFormatError, normalize_format_name

            try:
                entry["kv_format"] = normalize_format_name(kv_format)
            except KVFormatError as e:
                raise ConfigError(f"--kv-format: {e}") from None
        _say(f"serving {spec} as {model_id!r} with default settings")
        return parse_config({"models": [entry]}, source="MODEL", base_dir=Path.cwd())
    if path is None:
        _say("no config given: serving the embedded default model (models/orchard-tiny)")
        return default_config()
    return load_config(path)


def _runtime_env(extra: dict[str, str] | None = None) -> dict[str, Any]:
    from engine.platform import openblas_env

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**openblas_env(), "PYTHONPATH": os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH", "")) if p), **(extra or {})}
    return {"env_vars": env}


def direct_ingress_env(port: int, span: int = 0) -> dict[str, str]:
    """Ray Serve settings for direct ingress: the ingress replica serves HTTP on `port` itself
    (ports port..port+span), so requests skip the Serve proxy hop and the body fetch back to it
    (about 12 ms of the first token on a 2-core box). Cluster-wide: the controller allocates
    the ports, so they must be in the environment Ray starts with."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + span + 1),   # exclusive
            # A restarted ingress must get the same port back at once.
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
            # Serve's default holds an ingress for 30 s on shutdown for external load balancers.
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


# Ray starts its workers at niceness 15 so they yield to its own daemons; here the workers ARE
# the product (the model replica's engine thread, the ingress), and at 15 any process at normal
# priority on the box (a client, a tokenizer, the peer in a benchmark) takes the CPU from them:
# measured +24 ms on a 135M model's first token on a 2-core box.
# Ray's memory monitor kills workers when the whole box passes 95% of its memory. Orchard's
# replicas allocate their KV pools once, up front, within the memory plan (memory_plan.py), so
# what crosses the line is some other program; the monitor then killed Serve's controller and
# replicas (seen on a shared box: "The actor was restarted", the app never became ready).
# Killing the server does not give the other program memory it can keep, so it is off.
# A cluster started with `ray start` gets the same through RAY_worker_niceness=0 and
# RAY_memory_monitor_refresh_ms=0 (cluster.yaml).
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0, "memory_monitor_refresh_ms": 0}


def _connect(address: str | None, namespace: str, start_local: bool,
             cluster_env: dict[str, str] | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    _say("starting a local Ray instance" if start_local else f"connecting to Ray at {address}")
    if cluster_env:
        # A local Ray's controller and proxy inherit this process's environment.
        os.environ.update(cluster_env)
    ray.init(address=None if start_local else address, namespace=namespace,
             runtime_env=_runtime_env(cluster_env),
             include_dashboard=False if start_local else None, log_to_driver=False,
             _system_config=LOCAL_RAY_SYSTEM_CONFIG if start_local else None)


def _wait_port_free(host: str, port: int, timeout_s: float = 30.0) -> None:
    """Direct ingress gets exactly one port, and Serve blocks a port it once failed to bind: wait
    out a previous server's lingering workers rather than deploy an ingress with no port."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"HTTP port {host}:{port} is in use ({e.strerror}); "
                                       "stop what holds it or pass --port") from None
        time.sleep(0.5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(cfg, timeout_s: float, host: str | None = None, port: int | None = None,
           proxy_port: int | None = None) -> str:
    """Deploy the app on the connected cluster, report progress, return the healthy URL.

    `proxy_port`: with direct ingress the ingress replica owns the public port, and Serve's
    proxy (still started on the head) listens here instead."""
    from ray import serve

    http_host = host or cfg.http.host
    http_port = port or cfg.http.port
    serve.start(http_options={"host": http_host, "port": proxy_port or http_port})
    _ensure_capacity_actor(cfg)
    _say(f"deploying {len(cfg.models)} model(s): "
         + ", ".join(f"{m.id} x{m.replicas} [{cfg.kv_format_for(m)}]" for m in cfg.models))
    _run_nonblocking(cfg)
    wait_running(cfg.app_name, timeout_s)
    url = f"http://{'127.0.0.1' if http_host in ('0.0.0.0', '::') else http_host}:{http_port}"
    wait_healthy(url + cfg.route_prefix.rstrip("/"), timeout_s)
    return url


def _run_nonblocking(cfg) -> None:
    from ray import serve
    from ray.serve.api import RunTarget

    from serve_app.app import build_app

    serve.run_many([RunTarget(target=build_app(cfg), name=cfg.app_name,
                              route_prefix=cfg.route_prefix)],
                   wait_for_applications_running=False)


def _ensure_capacity_actor(cfg) -> None:
    try:
        from capacity.actor import get_or_create_actor
    except ImportError:
        _say("capacity actor not available in this build; routing by power-of-two")
        return
    get_or_create_actor(namespace=cfg.capacity.namespace, config=cfg.capacity.actor_config(),
                        snapshot_path=cfg.capacity.snapshot_path,
                        resources=cfg.capacity.actor_resources or None)


def wait_running(app_name: str, timeout_s: float) -> None:
    """Poll Serve status, printing each deployment's state as it changes (model loads)."""
    from ray import serve

    deadline, last = time.monotonic() + timeout_s, {}
    while True:
        app = serve.status().applications.get(app_name)
        if app is not None:
            for name, dep in app.deployments.items():
                line = f"{_label(dep.status)} " + ", ".join(
                    f"{n} {_label(s)}" for s, n in dep.replica_states.items())
                if last.get(name) != line:
                    _say(f"  {name}: {line}")
                    last[name] = line
            status = _label(app.status).upper()
            if status == "RUNNING":
                return
            if status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"application {app_name} {status.lower()}: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {app_name} not running after {timeout_s:.0f} s")
        time.sleep(1.0)


def _label(state) -> str:
    """Serve status fields are enums in some places and plain strings in others."""
    return str(getattr(state, "value", state)).lower()


def wait_healthy(base_url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(base_url + "/health", timeout=30)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health not healthy after {timeout_s:.0f} s")
        time.sleep(0.5)


def cmd_serve(args) -> int:
    cfg = _serve_config(args)
    start_local = args.address is None
    # Direct ingress is a cluster-wide Serve setting: only where we start Ray ourselves.
    direct = start_local and cfg.http.direct_ingress
    port = args.port or cfg.http.port
    if direct:
        _wait_port_free(args.host or cfg.http.host, port)
    _connect(args.address, cfg.capacity.namespace, start_local=start_local,
             cluster_env=direct_ingress_env(port) if direct else None)
    url = deploy(cfg, args.timeout, args.host, args.port,
                 proxy_port=_free_port() if direct else None)
    for line in startup_summary(cfg, url, _capacity_snapshot(url + cfg.route_prefix.rstrip("/"),
                                                              cfg)):
        _say(line)
    _say(f"ready: {url}/v1  (OpenAI-compatible; Ctrl-C stops)")
    # SIGTERM (service managers, `kill`) drains like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    finally:
        _say("shutting down (draining running requests)")
        from ray import serve

        serve.shutdown()
        if args.address is None:
            import ray

            ray.shutdown()


def _capacity_snapshot(base_url: str, cfg) -> dict | None:
    """GET /v1/models/capacity (the actor's feed: budgets and caps as routing sees them); None
    when it cannot be read, so the summary still prints what the config knows."""
    import httpx

    keys = cfg.all_api_keys()
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    try:
        r = httpx.get(base_url + "/v1/models/capacity", headers=headers, timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def startup_summary(cfg, url: str, snapshot: dict | None) -> list[str]:
    """One screen once healthy: per model its id and folder, KV format, KV budget in tokens
    (idle headroom on the capacity feed = the budget), concurrency (learned cap and the
    configured ceiling), then the URL. `snapshot`: /v1/models/capacity's body, or None."""
    feed = {m.get("model_id"): m for m in (snapshot or {}).get("models") or []
            if isinstance(m, dict)}
    lines = ["startup summary"]
    for m in cfg.models:
        f = feed.get(m.id) or {}
        budget = f.get("headroom_raw_tokens")
        caps = sorted({i.get("cap") for i in f.get("identities") or [] if i.get("cap")})
        cap = "/".join(str(c) for c in caps) if caps else "unknown"
        lines += [f"  model        {m.id}  ({m.path})",
                  f"  KV format    {cfg.kv_format_for(m)}",
                  "  KV budget    " + (f"{budget:,} tokens across {m.replicas} replica(s)"
                                       if isinstance(budget, int) else
                                       "unknown (capacity feed unavailable)")
                  + (f", largest request {f['max_request_raw_tokens']:,}"
                     if isinstance(f.get("max_request_raw_tokens"), int) else ""),
                  f"  concurrency  cap {cap} per replica (learned), ceiling "
                  f"{m.max_num_seqs} (max_num_seqs), x{m.replicas} replica(s)"]
    prefix = cfg.route_prefix.rstrip("/")
    lines += [f"  URL          {url}{prefix}/v1  (OpenAI-compatible; capacity: "
              f"{url}{prefix}/v1/models/capacity)"]
    return lines


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_import_gguf(args) -> int:
    from engine.model.gguf import GGUFImportError, import_gguf

    try:
        import_gguf(args.file, args.out_dir, dtype=args.dtype, overwrite=args.force)
    except GGUFImportError as e:
        print(f"orchard import-gguf: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_deploy(args) -> int:
    cfg = _load(args.config)
    _connect(args.address, cfg.capacity.namespace, start_local=False)
    url = deploy(cfg, args.timeout)
    _say(f"deployed {cfg.app_name}: {url}/v1")
    return 0


def cmd_status(args) -> int:
    from serve_app.status import print_status

    _connect(args.address, args.namespace, start_local=False)
    return print_status(args.app, args.namespace)


if __name__ == "__main__":
    raise SystemExit(main())
