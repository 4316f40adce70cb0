"""Plain-HTTP probes run before and after a load run (stdlib urllib: no gevent, no requests).

They find the model and its context, calibrate prompt length, read the advertised capacity, and
check that the capacity feed returns to idle afterwards. The capacity feed's exact schema belongs
to serve_app, so it is read by key names rather than a fixed layout.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from loadtest import prompts

CONTEXT_KEYS = ("max_model_len", "context_length", "max_context_length", "context_window",
                "max_position_embeddings")
CONCURRENCY_KEYS = ("max_concurrency", "serviceable_concurrency", "concurrency_cap",
                    "concurrency", "max_num_seqs", "cap")
RAW_TOKEN_KEYS = ("max_raw_tokens", "raw_tokens_total", "capacity_raw_tokens")
# Feed fields that measure work in flight; all must read zero once a run has drained.
BUSY_MARKERS = ("used", "running", "inflight", "in_flight", "reserved", "held", "waiting",
                "ongoing", "active")


def _request(url: str, body: dict | None = None, timeout: float = 30.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers or {}), exc.read()


def get_json(url: str, timeout: float = 10.0):
    """(status, parsed body or None)."""
    try:
        status, _, raw = _request(url, timeout=timeout)
    except (urllib.error.URLError, OSError):
        return None, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


def wait_ready(base: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in ("/health", "/v1/models"):
            status, _ = get_json(base + path, timeout=2.0)
            if status == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{base} not ready (/health, /v1/models) after {timeout:.0f}s")


def list_models(base: str) -> list[dict]:
    status, obj = get_json(base + "/v1/models")
    if status != 200 or not isinstance(obj, dict):
        return []
    return [m for m in obj.get("data", []) if isinstance(m, dict)]


def _find_number(obj, keys) -> float | None:
    """First numeric value under any of `keys`, searching nested dicts/lists depth-first."""
    if isinstance(obj, dict):
        for k in keys:
            if isinstance(obj.get(k), (int, float)) and not isinstance(obj.get(k), bool):
                return float(obj[k])
        children = obj.values()
    elif isinstance(obj, list):
        children = obj
    else:
        return None
    for child in children:
        found = _find_number(child, keys)
        if found is not None:
            return found
    return None


def _entry_for(obj, model: str | None):
    """The sub-object describing `model` in a models/capacity document, else the whole thing."""
    items = obj.get("data") or obj.get("models") if isinstance(obj, dict) else obj
    if isinstance(items, dict) and model in items:
        return items[model]
    if isinstance(items, list):
        for it in items:
            if isinstance(it, dict) and model in (it.get("id"), it.get("model")):
                return it
    return obj


def context_length(models: list[dict], model: str | None) -> int | None:
    value = _find_number(_entry_for({"data": models}, model), CONTEXT_KEYS)
    return int(value) if value else None


def capacity_feed(base: str) -> dict | None:
    status, obj = get_json(base + "/v1/models/capacity")
    return obj if status == 200 and isinstance(obj, (dict, list)) else None


def advertised_concurrency(feed, model: str | None, raw_tokens_per_request: int) -> int | None:
    """Concurrent requests the feed says the model can serve: a concurrency figure if present,
    else its raw-token budget divided by one request's raw tokens (prompt + max tokens)."""
    if feed is None:
        return None
    entry = _entry_for(feed, model)
    conc = _find_number(entry, CONCURRENCY_KEYS)
    if conc:
        return int(conc)
    raw = _find_number(entry, RAW_TOKEN_KEYS)
    if raw and raw_tokens_per_request > 0:
        return max(1, int(raw // raw_tokens_per_request))
    return None


def busy_values(obj, path: str = "") -> dict[str, float]:
    """Numeric feed fields whose names mark work in flight, by dotted path."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if any(m in str(k).lower() for m in BUSY_MARKERS):
                    out[p] = float(v)
            else:
                out.update(busy_values(v, p))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(busy_values(v, f"{path}[{i}]"))
    return out


def wait_idle(base: str, timeout: float = 20.0) -> dict:
    """Poll the capacity feed until every in-flight field reads zero; report what it saw."""
    deadline = time.monotonic() + timeout
    busy: dict[str, float] = {}
    while True:
        feed = capacity_feed(base)
        if feed is None:
            return {"checked": False, "idle": None, "reason": "no /v1/models/capacity feed"}
        busy = {k: v for k, v in busy_values(feed).items() if v != 0}
        if not busy or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return {"checked": True, "idle": not busy, "busy_fields": busy,
            "fields_seen": len(busy_values(feed))}


def calibrate(base: str, api: str, model: str | None) -> tuple[prompts.Calibration, float]:
    """Two short non-streaming probes fix tokens per word and template overhead; also warms the
    server. Returns the calibration and the slower probe's latency in seconds."""
    points, slowest = [], 0.0
    for n_words in (40, 200):
        body = prompts.request_body(api, model, prompts.words(n_words, seed=n_words), 1,
                                    stream=False)
        t0 = time.perf_counter()
        status, _, raw = _request(base + prompts.endpoint(api), body, timeout=120.0)
        slowest = max(slowest, time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"calibration probe got HTTP {status}: {raw[:300]!r}")
        usage = json.loads(raw).get("usage") or {}
        if not usage.get("prompt_tokens"):
            return prompts.Calibration(), slowest
        points.append((n_words, int(usage["prompt_tokens"])))
    return prompts.fit(points), slowest
