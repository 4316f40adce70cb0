"""The `orchard` commands that run the service: serve (start or join Ray, deploy, block), deploy,
status and import-gguf, and what `orchard serve` resolves its MODEL|CONFIG argument to."""
from __future__ import annotations

import signal
import sys
import time

from serve_app.launch import (connect, deploy, direct_ingress_env, free_port, say,
                              wait_port_free)


def is_config_path(target: str) -> bool:
    """A positional `orchard serve` argument is a config when it names a YAML file."""
    return target.lower().endswith((".yaml", ".yml"))


def serve_config(args):
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
        say(f"serving {spec} as {model_id!r} with default settings")
        return parse_config({"models": [entry]}, source="MODEL", base_dir=Path.cwd())
    if path is None:
        say("no config given: serving the embedded default model (models/orchard-tiny)")
        return default_config()
    return load_config(path)


def cmd_serve(args) -> int:
    cfg = serve_config(args)
    start_local = args.address is None
    # Direct ingress is a cluster-wide Serve setting: only where we start Ray ourselves.
    direct = start_local and cfg.http.direct_ingress
    port = args.port or cfg.http.port
    if direct:
        wait_port_free(args.host or cfg.http.host, port)
    connect(args.address, cfg.capacity.namespace, start_local=start_local,
             cluster_env=direct_ingress_env(port) if direct else None)
    url = deploy(cfg, args.timeout, args.host, args.port,
                 proxy_port=free_port() if direct else None)
    for line in startup_summary(cfg, url, _capacity_snapshot(url + cfg.route_prefix.rstrip("/"),
                                                              cfg)):
        say(line)
    say(f"ready: {url}/v1  (OpenAI-compatible; Ctrl-C stops)")
    # SIGTERM (service managers, `kill`) drains like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    finally:
        say("shutting down (draining running requests)")
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
    connect(args.address, cfg.capacity.namespace, start_local=False)
    url = deploy(cfg, args.timeout)
    say(f"deployed {cfg.app_name}: {url}/v1")
    return 0


def cmd_status(args) -> int:
    from serve_app.status import print_status

    connect(args.address, args.namespace, start_local=False)
    return print_status(args.app, args.namespace)
