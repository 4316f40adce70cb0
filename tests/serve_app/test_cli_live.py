"""`orchard serve CONFIG` end to end: a local Ray of its own, Serve direct ingress on http.port
(the ingress replica serves HTTP itself; Serve's proxy moves to a spare port), a streamed chat
with the per-hop trace off, and a clean SIGTERM drain.

Runs the real CLI in a subprocess with its own RAY_TMPDIR, so nothing else on the machine
auto-connects to its Ray, and stops only the process group it started.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from engine.platform import openblas_env
from tests.fixtures.serve import TEST_API_KEY, free_port, make_config, wait_cli_ready

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}


def _listeners(port: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if f":{port} " in l]


def _listener_is_serve_replica(port: int) -> bool:
    """The public port is held by the ingress replica, not by Serve's proxy actor."""
    lines = _listeners(port)
    return bool(lines) and all("ServeRepli" in l for l in lines)


def _niceness(pid: int) -> int:
    """Field 19 of /proc/PID/stat (after the parenthesised command name)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


class _Stream(threading.Thread):
    """A streamed chat read to its end in a thread; records its SSE data lines."""

    def __init__(self, base: str, max_tokens: int):
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.status, self.error, self.events = None, None, []
        self.first_content = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "stream": True, "max_tokens": self.max_tokens,
                "ignore_eos": True, "messages": [{"role": "user", "content": "go on"}]}
        try:
            with httpx.stream("POST", self.base + "/v1/chat/completions", headers=AUTH,
                              json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line)
                        self.first_content.set()
        except httpx.HTTPError as e:
            self.error = repr(e)
        finally:
            self.first_content.set()


def test_orchard_serve_uses_direct_ingress_and_drains_on_sigterm(tiny_llama, tmp_path):
    port = free_port()
    cfg = make_config(tiny_llama, port, f"orchard-cli-{os.getpid()}")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ray_tmp = tempfile.mkdtemp(prefix="orc", dir="/tmp")   # short: Unix socket paths
    env = {**os.environ, **openblas_env(), "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp,
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    env.pop("ORCHARD_TRACE", None)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serve_app.cli", "serve", str(path)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_cli_ready(proc, log)
        base = f"http://127.0.0.1:{port}"
        assert _listener_is_serve_replica(port)
        # Ray starts workers at niceness 15; the serving workers must not yield the CPU to
        # every other process on the box (serve_app.launch.LOCAL_RAY_SYSTEM_CONFIG): they keep the
        # niceness of the `orchard serve` that started them (this test's own, when run under nice).
        pids = {int(m) for l in _listeners(port) for m in re.findall(r"pid=(\d+)", l)}
        own = os.nice(0)
        assert pids and all(_niceness(p) == own for p in pids), {p: _niceness(p) for p in pids}
        with httpx.Client(base_url=base, timeout=120) as c:
            assert c.get("/health").status_code == 200
            body = {"model": "tiny", "stream": True, "max_tokens": 3, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "hi"}]}
            with c.stream("POST", "/v1/chat/completions", headers=AUTH, json=body) as r:
                assert r.status_code == 200
                assert r.headers["x-orchard-replica"] and "x-orchard-trace" not in r.headers
                events = [l for l in r.iter_lines() if l.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and any('"content"' in e for e in events)
            bad = c.post("/v1/chat/completions", headers=AUTH, json={**body, "max_tokens": 0})
            assert bad.status_code == 400
        # SIGTERM under load: streams in flight end cleanly ([DONE], after an error event if
        # the drain cut them) and nobody hangs.
        streams = [_Stream(base, max_tokens=400) for _ in range(3)]
        for st in streams:
            st.start()
        for st in streams:
            assert st.first_content.wait(60) and st.status == 200, (st.status, st.error)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for st in streams:
            st.join(120)
            assert not st.is_alive(), "a stream hung through the SIGTERM drain"
            assert st.error is None and st.events[-1] == "data: [DONE]", (st.error,
                                                                          st.events[-3:])
        assert proc.wait(timeout=120) in (0, 130), log.read_text()[-4000:]
        assert time.monotonic() - t0 < 60, "direct ingress held the shutdown"
        print(f"\nSIGTERM under load: {len(streams)} streams ended cleanly, process exited "
              f"{time.monotonic() - t0:.1f} s after the signal")
        # The port is free again: the next `orchard serve` can take it.
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
