"""Start and stop `orchard serve --model MODEL` for a side-by-side bench, like peer.py does for
`mlx_lm.server`: a child process in its own session, on a free port, with a Ray of its own
(RAY_TMPDIR) and a fresh home (so no learned-rates snapshot from an earlier run is reused: each
bench starts from the defaults a new user gets). Talks to it over HTTP only."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass

from loadtest import peer, probe


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
          config: str | None = None) -> OrchardServer:
    """Launch `orchard serve --model MODEL --port P` (or `orchard serve CONFIG --port P`) and
    wait until /health answers 200."""
    if (model is None) == (config is None):
        raise ValueError("give exactly one of model and config")
    port = peer.free_port()
    scratch = tempfile.mkdtemp(prefix="orc-bench-", dir="/tmp")   # short: Ray's socket paths
    env = {**peer.peer_env(), "RAY_TMPDIR": scratch, "HOME": scratch,
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    what = ["--model", model] if model is not None else [config]
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
