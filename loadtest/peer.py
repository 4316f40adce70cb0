"""Start and stop `mlx_lm.server`, the peer a Mac user would run instead of Orchard.

The peer runs as a child process on a free local port with OpenBLAS preloaded on Linux (MLX's CPU
wheel otherwise uses a reference BLAS about 9x slower, which would make the comparison unfair).
The preload path list mirrors engine.platform on purpose: loadtest imports nothing from engine.
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from loadtest import probe

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    if platform.system() == "Linux":
        lib = next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)
        if lib and lib not in env.get("LD_PRELOAD", "").split(":"):
            env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD")) if x)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Peer:
    proc: subprocess.Popen
    url: str
    model: str
    log_path: str

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(model: str, port: int | None = None, log_path: str | None = None,
          extra_args: tuple[str, ...] = (), ready_timeout: float = 120.0) -> Peer:
    """Launch `python -m mlx_lm server --model MODEL` and wait until /v1/models answers."""
    port = port or free_port()
    log_path = log_path or os.path.join("/tmp", f"mlx_lm_server_{port}.log")
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "WARNING", *extra_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=peer_env())
    log.close()
    peer = Peer(proc, f"http://127.0.0.1:{port}", model, log_path)
    deadline = time.monotonic() + ready_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited with {proc.returncode}; see {log_path}")
            try:
                probe.wait_ready(peer.url, timeout=1.0)
                return peer
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
    except BaseException:
        peer.stop()
        raise
