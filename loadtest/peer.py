"""Start and stop `mlx_lm.server`, the peer a Mac user would run instead of Orchard.

The peer runs as a child process on a free local port with OpenBLAS preloaded on Linux (MLX's CPU
wheel otherwise uses a reference BLAS about 9x slower, which would make the comparison unfair).
The preload path list mirrors engine.platform on purpose: loadtest imports nothing from engine.
"""
from __future__ import annotations

import hashlib
import os
import platform
import signal
import socket
import tempfile
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


def default_dtype() -> str:
    """What the peer should compute in for a fair comparison: on Linux MLX runs on the CPU here,
    where bf16 matmul is slow and Orchard's engine computes in float32, so the peer gets a
    float32 copy; elsewhere (Metal) the model as shipped."""
    return "float32" if platform.system() == "Linux" else "as-is"


def prepare_model(model: str, dtype: str) -> str:
    """`model` itself, or a cached copy converted to `dtype` with `mlx_lm convert` (local paths;
    a hub id is passed through unchanged)."""
    if dtype == "as-is" or not os.path.isdir(model):
        return model
    src = os.path.abspath(model)
    stamp = f"{src}:{max(os.path.getmtime(os.path.join(src, f)) for f in os.listdir(src))}"
    digest = hashlib.sha1(stamp.encode()).hexdigest()[:10]
    out = os.path.join(tempfile.gettempdir(), "orchard-peer-models",
                       f"{os.path.basename(src)}-{dtype}-{digest}")
    if not os.path.exists(os.path.join(out, "config.json")):
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", src,
                        "--mlx-path", out, "--dtype", dtype], check=True, env=peer_env(),
                       stdout=subprocess.DEVNULL)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_child(proc: subprocess.Popen, timeout: float, group: bool = False) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited after `timeout`;
    `group`: signal the child's whole process group (a server that started its own helpers)."""
    if proc.poll() is not None:
        return
    send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    send(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(10)


@dataclass
class Peer:
    proc: subprocess.Popen
    url: str
    model: str
    log_path: str

    def stop(self, timeout: float = 10.0) -> None:
        stop_child(self.proc, timeout)

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
