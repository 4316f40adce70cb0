"""What the ingress sends a model replica (one plain, picklable record per request)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

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
    request_id: str
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Wall-clock (time.time()) deadline: monotonic clocks differ between processes and nodes.
    first_token_deadline_unix: float | None = None
    # Debug only (ORCHARD_TRACE=1): hop name -> time.time(), filled along the path.
    trace: dict | None = None

    @property
    def raw_tokens(self) -> int:
        """Prompt + max tokens, as the user asked: the unit budgets and holds are priced in."""
        return len(self.prompt_ids) + self.max_tokens

    def deadline_monotonic(self) -> float | None:
        if self.first_token_deadline_unix is None:
            return None
        return time.monotonic() + (self.first_token_deadline_unix - time.time())
