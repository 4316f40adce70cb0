"""One streaming OpenAI request over geventhttpclient, timestamped event by event.

Locust's FastHttp `iter_content(1024)` blocks until 1024 bytes arrive, so TTFT would read as E2E;
`readline` on the raw geventhttpclient response returns each SSE line as soon as its bytes land
(the parser under it also undoes chunked transfer encoding).
"""
from __future__ import annotations

import time

import gevent
from gevent import GreenletExit

from loadtest.records import RequestRecord
from loadtest.sse import SSEParser, parse_event

perf = time.perf_counter
HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream",
           "Accept-Encoding": "identity"}  # compressed SSE would be buffered by the decoder


class _Hung(Exception):
    """The stream outlived the run's patience."""


def stream_one(client, path: str, body: bytes, rec: RequestRecord, t0: float,
               timeout_s: float, headers: dict | None = None) -> None:
    """Send now, fill `rec` (status, text event times, usage, errors) as the stream arrives.
    On a retry `rec.sent` is kept, so event times count from the user's first attempt."""
    if rec.sent is None:
        rec.sent = perf() - t0
    start = t0 + rec.sent
    resp = None
    try:
        with gevent.Timeout(timeout_s, _Hung):
            resp = client.request("POST", path, body=body, headers={**HEADERS, **(headers or {})})
            rec.status = resp.status_code
            rec.retry_after = resp.get("retry-after")
            if rec.status != 200:
                rec.error = f"HTTP {rec.status}: {resp.read()[:200].decode(errors='replace')}"
                rec.done = perf() - start
                return
            _consume(resp, rec, start)
    except _Hung:
        rec.hung = True
        rec.done = perf() - start  # when it was cut: the run's wall time must include it
    except GreenletExit:
        rec.hung = True  # killed at the end of the run while still open
        rec.done = perf() - start
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is data for the report
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if resp is not None:
            resp.release()


def _consume(resp, rec: RequestRecord, start: float) -> None:
    parser = SSEParser()
    saw_done = False
    usage = None
    while not saw_done:
        line = resp.readline(b"\n")
        now = perf() - start
        payloads = parser.feed(line) if line else parser.close()
        for payload in payloads:
            chunk = parse_event(payload)
            if chunk.done:
                saw_done = True
                break
            if chunk.error:
                rec.error = f"stream error: {chunk.error}"[:300]
            if chunk.text:
                rec.chunk_times.append(now)
                rec.text += chunk.text
            if chunk.finish_reason:
                rec.finish_reason = chunk.finish_reason
            if chunk.usage:
                usage = chunk.usage
        if not line:
            break
    rec.done = perf() - start
    if not saw_done and rec.error is None:
        rec.error = "stream ended without [DONE]"
    if usage and usage.get("completion_tokens") is not None:
        rec.output_tokens = rec.usage_tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:
        rec.usage_missing = True
        rec.output_tokens = len(rec.chunk_times)


def retry_delay(retry_after: str | None, default: float = 1.0, cap: float = 30.0) -> float:
    """Seconds to wait before retrying a refused request (Retry-After in seconds; HTTP dates are
    not used by OpenAI-style servers and fall back to the default)."""
    try:
        return min(cap, max(0.0, float(retry_after))) if retry_after else default
    except ValueError:
        return default
