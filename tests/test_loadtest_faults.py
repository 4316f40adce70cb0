"""The whole runner (Locust child process) against a scripted stub server: TTFT is the first
token, not the end of the stream; refusals, 5xx, missing Retry-After and hung streams are each
classified and fail the overload rules."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

FIRST_TOKEN_S, TOKEN_GAP_S, TOKENS = 0.3, 0.1, 3


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    counter = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _json(self, code, obj, headers=()):
        raw = json.dumps(obj).encode()
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self.path == "/v1/models/capacity":
            self._json(200, {"models": [{"id": "stub", "max_concurrency": 2, "running": 0}]})
        elif self.path in ("/health", "/v1/models"):
            self._json(200, {"data": [{"id": "stub", "max_model_len": 1024}]})
        else:
            self._json(404, {})

    def _chunk(self, obj):
        data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not body.get("stream"):
            words = len(body["messages"][0]["content"].split())
            self._json(200, {"choices": [{"message": {"content": "x"}}],
                             "usage": {"prompt_tokens": 2 * words + 5, "completion_tokens": 1}})
            return
        with Stub.lock:
            n, Stub.counter = Stub.counter, Stub.counter + 1
        kind = n % 5
        if kind == 1:
            return self._json(429, {"error": {"message": "busy"}}, [("Retry-After", "1")])
        if kind == 2:
            return self._json(503, {"error": {"message": "busy"}})  # no Retry-After: a violation
        if kind == 3:
            return self._json(500, {"error": {"message": "boom"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        time.sleep(FIRST_TOKEN_S)
        self._chunk({"choices": [{"delta": {"content": "a"}}]})
        if kind == 4:
            time.sleep(30)  # hangs: the client must give up and call it hung
            return
        for _ in range(TOKENS - 1):
            time.sleep(TOKEN_GAP_S)
            self._chunk({"choices": [{"delta": {"content": "b"}}]})
        self._chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": TOKENS}})
        self._chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_overload_classification_against_stub(stub_url, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "loadtest", "run", "--host", stub_url, "--scenario", "overload",
           "--burst-period", "1", "--duration", "2", "--max-tokens", "8",
           "--stream-timeout", "3", "--drain-timeout", "10", "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the run must not pass
    assert time.monotonic() - t0 < 60
    s = json.loads((out / "summary.json").read_text())
    # capacity 2 from the feed -> 3x = bursts of 6, two bursts
    assert s["counts"]["scheduled"] == 12 and s["counts"]["sent"] == 12
    assert s["counts"] | {} == s["counts"]
    assert s["counts"]["ok"] == 3 and s["counts"]["refused"] == 5
    assert s["refusals_by_status"] == {"429": 3, "503": 2}
    assert s["refusals_without_retry_after"] == 2
    assert s["errors_by_status"] == {"500": 2, "hung": 2}
    rules = s["overload_rules"]
    assert not rules["passed"] and not rules["refusals_carry_retry_after"]
    assert not rules["zero_other_5xx"] and not rules["zero_hung_streams"]
    # TTFT is the first token (~0.3 s), not the stream's end (~0.5 s)
    ttft, e2e = s["metrics"]["ttft_ms"], s["metrics"]["e2e_ms"]
    assert 250 <= ttft["p50"] <= 400, ttft
    assert e2e["p50"] - ttft["p50"] >= 150, (ttft, e2e)
    assert s["metrics"]["output_tokens"]["p50"] == TOKENS
    assert s["capacity_after"]["idle"] is True
    assert s["delivery_error_ms"]["n"] == 12 and s["delivery_error_ms"]["p99"] is not None
    for f in ("locust.html", "locust_stats.csv", "ttft_cdf.png", "refusals.png",
              "output_tokens_per_s.png"):
        assert (out / f).stat().st_size > 0, f
    stats = (out / "locust_stats.csv").read_text()
    assert "ttft_ms [stub|-]" in stats and "delivery_error_ms [stub|-]" in stats
