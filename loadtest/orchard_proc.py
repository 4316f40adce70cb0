"""Start and stop `orchard serve --model MODEL [--kv-format F]` for a side-by-side bench, like
peer.py does for `mlx_lm.server`: a child process in its own session, on a free port, with a Ray
of its own (RAY_TMPDIR) and a fresh home (so no learned-rates snapshot from an earlier run is
reused: each bench starts from the defaults a new user gets). Talks to it over HTTP only."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from loadtest import peer, probe
from loadtest.models import served_id
from loadtest.runner import Target


@dataclass
class OrchardServer:
    proc: subprocess.Popen
    url: str
    log_path: str
    scratch: str

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to its process group (Orchard drains), SIGKILL if it does not exit."""
        peer.stop_child(self.proc, timeout, group=True)


def start(model: str | None, log_path: str, ready_timeout: float = 600.0,
          config: str | None = None, kv_format: str | None = None) -> OrchardServer:
    """Launch `orchard serve --model MODEL [--kv-format F] --port P` (or `orchard serve CONFIG
    --port P`) and wait until /health answers 200."""
    if (model is None) == (config is None):
        raise ValueError("give exactly one of model and config")
    port = peer.free_port()
    scratch = tempfile.mkdtemp(prefix="orc-bench-", dir="/tmp")   # short: Ray's socket paths
    env = {**peer.peer_env(), "RAY_TMPDIR": scratch, "HOME": scratch,
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    what = ["--model", model] if model is not None else [config]
    what += ["--kv-format", kv_format] if kv_format is not None else []
    cmd = [sys.executable, "-m", "serve_app.cli", "serve", *what,
           "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = OrchardServer(proc, f"http://127.0.0.1:{port}", log_path, scratch)
    try:
        # /health, not /v1/models: the ingress lists models before any replica is ready.
        probe.wait_child_healthy(proc, server.url, "orchard serve", log_path, ready_timeout, 1.0)
        return server
    except BaseException:
        server.stop()
        raise


def label(kv_format: str) -> str:
    """A bench target's name: `orchard` for native KV (as before formats were compared),
    `orchard-F` for format F."""
    return "orchard" if kv_format == "native" else f"orchard-{kv_format}"


def start_for_bench(model: str, kv_format: str, out_dir: str,
                    version: str) -> tuple[OrchardServer, Target, dict]:
    """One bench target: `orchard serve --model MODEL [--kv-format F]`, logging into OUT_DIR;
    (the server, its target, what the bench records of it, identities included)."""
    name, model_id = label(kv_format), served_id(model)
    cmd = f"orchard serve --model {model}" + \
        (f" --kv-format {kv_format}" if kv_format != "native" else "")
    print(f"[loadtest] starting {cmd}", flush=True)
    server = start(model, os.path.join(out_dir, f"{name.replace('-', '_')}_serve.log"),
                   kv_format=None if kv_format == "native" else kv_format)
    try:
        identities = served_identities(server.url, model_id)
    except BaseException:
        server.stop()
        raise
    return server, Target(server.url, model_id, kv_format, name), {
        "server": "orchard serve", "version": version, "command": cmd,
        "settings": "defaults (fresh Ray, fresh learned rates)", "identities": identities}


def served_identities(url: str, model_id: str, timeout: float = 120.0) -> list[dict]:
    """What the server really runs, for the bench's record: the execution identities its
    capacity actor holds for MODEL_ID, each with its cap at start and where that cap came from
    (a quantized identity starts calibrated from its warm-up, or at the seed's 1). /health is
    200 before the replica's first heartbeat reaches the actor, so this waits for that report;
    a server that never reports one within TIMEOUT is an error."""
    deadline = time.monotonic() + timeout
    while True:
        feed = probe.capacity_feed(url) or {}
        for m in feed.get("models", []) if isinstance(feed, dict) else []:
            if m.get("model_id") == model_id and m.get("identities"):
                return [{k: i.get(k) for k in ("identity", "chip_class", "cap", "cap_source")}
                        for i in m["identities"]]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/v1/models/capacity named no identity for {model_id!r} "
                               f"within {timeout:.0f} s")
        time.sleep(0.5)   # polling a condition: the next heartbeat, not a fixed wait
