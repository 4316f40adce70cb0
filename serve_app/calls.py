"""What the ingress sends a model replica (one plain, picklable record per request choice)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from engine.request import GenerationRequest

TRACE_ENV = "ORCHARD_TRACE"


def tracing() -> bool:
    """Per-hop timestamps on (debug; the serving-path bench's --trace sets it in every process)."""
    return os.environ.get(TRACE_ENV) == "1"


def stamp(trace: dict | None, key: str) -> None:
    """Record wall-clock time at a hop (wall clock: the hops run in different processes)."""
    if trace is not None:
        trace[key] = time.time()


@dataclass
class GenerateCall:
    """One choice of one request: the engine's own GenerationRequest (pure Python, no MLX),
    built and validated once at the ingress and handed through, plus the facts routing needs."""

    request: GenerationRequest   # its first_token_deadline stays None: clocks differ
    model: str
    # Wall-clock (time.time()) deadline: monotonic clocks differ between processes and nodes.
    first_token_deadline_unix: float | None = None
    # Debug only (ORCHARD_TRACE=1): hop name -> time.time(), filled along the path.
    trace: dict | None = None
    # The Ray actor name of the ingress replica that sent it (None outside Ray): when that actor
    # is gone nobody can read the stream, so the model replica cancels the request.
    caller: str | None = None

    @property
    def raw_tokens(self) -> int:
        """Prompt + max tokens, as the user asked: the unit budgets and holds are priced in."""
        return len(self.request.prompt_ids) + self.request.params.max_tokens

    def deadline_monotonic(self) -> float | None:
        if self.first_token_deadline_unix is None:
            return None
        return time.monotonic() + (self.first_token_deadline_unix - time.time())

    def engine_request(self) -> GenerationRequest:
        """The request for this process's engine: the wall-clock deadline on its own clock."""
        deadline = self.deadline_monotonic()
        if deadline is None:
            return self.request
        return replace(self.request, first_token_deadline=deadline)
