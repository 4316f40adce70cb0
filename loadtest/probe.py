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
# Orchard's feed (capacity.fleet.snapshot) says headroom_requests / headroom_raw_tokens per
# model; the other names cover feeds shaped like other servers'.
CONCURRENCY_KEYS = ("headroom_requests", "max_concurrency", "serviceable_concurrency",
                    "concurrency_cap", "concurrency", "max_num_seqs", "cap")
RAW_TOKEN_KEYS = ("headroom_raw_tokens", "max_raw_tokens", "raw_tokens_total")
# Feed fields that measure work in flight; all must read zero once a run has drained.
BUSY_MARKERS = ("used", "running", "inflight", "in_flight", "reserved", "held", "waiting",
                "ongoing", "active", "outstanding")
# Lifetime counters only grow; they say nothing about idleness.
SKIP_SUBTREES = ("counters", "totals")


def _request(url: str, body: dict | None = None, timeout: float = 30.0, key: str | None = None):
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers or {}), exc.read()


def get_json(url: str, timeout: float = 10.0, key: str | None = None):
    """(status, parsed body or None)."""
    try:
        status, _, raw = _request(url, timeout=timeout, key=key)
    except (urllib.error.URLError, OSError):
        return None, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


def wait_ready(base: str, timeout: float = 60.0, key: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in ("/health", "/v1/models"):
            status, _ = get_json(base + path, timeout=2.0, key=key)
            if status == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{base} not ready (/health, /v1/models) after {timeout:.0f}s")


def wait_child_healthy(proc, base: str, name: str, log_path: str, timeout: float,
                       poll_s: float) -> None:
    """Wait until the server child `proc` answers 200 on `base`/health (both Orchard and
    llama-server answer it only once they can serve); raise if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {_last_line(log_path)} "
                               f"(see {log_path})")
        status, _ = get_json(base + "/health", timeout=2.0)
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready after {timeout:.0f} s; see {log_path}")
        time.sleep(poll_s)


def _last_line(path: str) -> str:
    """A failed child's own last word (a config error names its cause), or '' if none."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read()[-4000:].splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def list_models(base: str, key: str | None = None) -> list[dict]:
    status, obj = get_json(base + "/v1/models", key=key)
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
            if isinstance(it, dict) and model in (it.get("id"), it.get("model"),
                                                  it.get("model_id")):
                return it
    return obj


def context_length(models: list[dict], model: str | None) -> int | None:
    value = _find_number(_entry_for({"data": models}, model), CONTEXT_KEYS)
    return int(value) if value else None


def capacity_feed(base: str, key: str | None = None) -> dict | None:
    status, obj = get_json(base + "/v1/models/capacity", key=key)
    return obj if status == 200 and isinstance(obj, (dict, list)) else None


def advertised_concurrency(feed, model: str | None, raw_tokens_per_request: int) -> int | None:
    """Concurrent requests the feed says the model can serve: the smaller of its concurrency
    figure and its raw-token budget divided by one request's raw tokens (prompt + max tokens)."""
    if feed is None:
        return None
    entry = _entry_for(feed, model)
    conc = _find_number(entry, CONCURRENCY_KEYS)
    raw = _find_number(entry, RAW_TOKEN_KEYS)
    by_tokens = int(raw // raw_tokens_per_request) if raw and raw_tokens_per_request > 0 else None
    found = [int(x) for x in (conc, by_tokens) if x]
    return max(1, min(found)) if found else None


def busy_values(obj, path: str = "") -> dict[str, float]:
    """Numeric feed fields whose names mark work in flight, by dotted path."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            if str(k).lower() in SKIP_SUBTREES:
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if any(m in str(k).lower() for m in BUSY_MARKERS):
                    out[p] = float(v)
            else:
                out.update(busy_values(v, p))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(busy_values(v, f"{path}[{i}]"))
    return out


def headroom_values(obj, path: str = "") -> dict[str, float]:
    """Numeric feed fields named *headroom* (but not *requests*): free token/byte capacity, back
    to its idle value after a run. Headroom in requests also follows the concurrency caps the
    service learns during the run, so a changed value there is not a leak."""
    out: dict[str, float] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) \
        else ()
    for k, v in items:
        p = f"{path}.{k}" if path else str(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if "headroom" in str(k).lower() and "request" not in str(k).lower():
                out[p] = float(v)
        elif str(k).lower() not in SKIP_SUBTREES:
            out.update(headroom_values(v, p))
    return out


def wait_idle(base: str, before: dict | None, timeout: float = 20.0,
              key: str | None = None) -> dict:
    """Poll the capacity feed until nothing is in flight and every token headroom figure is
    back to at least its value `before` the run; report what it saw."""
    deadline = time.monotonic() + timeout
    base_room = headroom_values(before) if before else {}
    while True:
        feed = capacity_feed(base, key)
        if feed is None:
            return {"checked": False, "idle": None, "reason": "no /v1/models/capacity feed"}
        busy = {k: v for k, v in busy_values(feed).items() if v != 0}
        room = headroom_values(feed)
        short = {k: (room.get(k), v) for k, v in base_room.items() if room.get(k, 0) < v}
        if (not busy and not short) or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return {"checked": True, "idle": not busy and not short, "busy_fields": busy,
            "headroom_short": short, "headroom_after": room}


def calibrate(base: str, api: str, model: str | None,
              key: str | None = None) -> tuple[prompts.Calibration, float]:
    """Two short non-streaming probes fix tokens per word and template overhead; also warms the
    server. Returns the calibration and the slower probe's latency in seconds."""
    points, slowest = [], 0.0
    for n_words in (40, 200):
        body = prompts.request_body(api, model, prompts.words(n_words, seed=n_words), 1,
                                    stream=False)
        t0 = time.perf_counter()
        status, _, raw = _request(base + prompts.endpoint(api), body, timeout=120.0, key=key)
        slowest = max(slowest, time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"calibration probe got HTTP {status}: {raw[:300]!r}")
        usage = json.loads(raw).get("usage") or {}
        if not usage.get("prompt_tokens"):
            return prompts.Calibration(), slowest
        points.append((n_words, int(usage["prompt_tokens"])))
    return prompts.fit(points), slowest
