"""A replica engine's trace events as JSON lines, for reading a served run step by step.

`ORCHARD_STEP_LOG=PREFIX` (in the environment of `orchard serve`, which its local Ray passes to
the replicas) makes each replica append to `PREFIX.<pid>.jsonl` one line per step (prefill tokens,
decode rows, seconds, model calls and compiled traces so far) and per arrival, admission and
refund, each with the engine thread's monotonic time. Off by default: it costs a write per step.
bench/device/serve_run.sh turns it on to find where a saturated run's time went.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable

STEP_LOG_ENV = "ORCHARD_STEP_LOG"
LOGGED_EVENTS = frozenset({"step", "arrival", "admit", "refund"})
FLUSH_S = 0.5


def step_log_from_env() -> Callable[..., None] | None:
    """An Engine `trace` callable writing LOGGED_EVENTS, or None when the variable is unset."""
    prefix = os.environ.get(STEP_LOG_ENV)
    if not prefix:
        return None
    # Buffered, not line-buffered: a write per step cost the engine thread a system call per
    # token (~1.5 % of an 8B batch-1 step on the H200, serve_profile run 9). Lines are flushed
    # at every per-request event (arrival, admission, refund) and at least every FLUSH_S, so a
    # kill loses at most that much of the step record.
    out = open(f"{prefix}.{os.getpid()}.jsonl", "a", buffering=1 << 16)
    last = [time.monotonic()]

    def trace(event: str, **fields) -> None:
        if event in LOGGED_EVENTS:
            now = time.monotonic()
            out.write(json.dumps({"t": now, "event": event, **fields}, default=str) + "\n")
            if event != "step" or now - last[0] >= FLUSH_S:
                out.flush()
                last[0] = now
    return trace
