"""One record per scheduled request, and the latency metrics derived from it.

Times are seconds on the run's perf_counter clock, relative to the run start (`scheduled`, `sent`)
or to the request's own send (`chunk_times`, `done`). Metric definitions follow vLLM/AIPerf:
TTFT = first generated text - send; ITL = gaps between text events; TPOT = (E2E - TTFT) /
(output tokens - 1); E2E = send -> end of stream.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

REFUSAL_STATUSES = (429, 503)


@dataclass
class RequestRecord:
    index: int
    pattern: str
    prompt_tokens_target: int
    max_tokens: int
    scheduled: float
    sent: float | None = None             # when the request was handed to the socket
    status: int | None = None
    retry_after: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # each text event, from send
    done: float | None = None             # end of stream, from send
    output_tokens: int | None = None      # counted from `text` with the model's tokenizer
                                          # (--tokenizer), else usage.completion_tokens
    prompt_tokens: int | None = None      # server usage.prompt_tokens
    cached_tokens: int | None = None      # usage.prompt_tokens_details.cached_tokens, if sent
    usage_missing: bool = False           # server sent no usage; output_tokens = text events
    usage_tokens: int | None = None       # what the server's usage said, kept to compare
    tokens_from: str = "usage"            # "text" once recounted with the tokenizer
    text: str = ""                        # the generated text as the client received it
    finish_reason: str | None = None
    error: str | None = None
    hung: bool = False                    # still streaming when the run's patience ran out
    refused_attempts: int = 0             # refusals retried after Retry-After (--retry-refused)

    def reset_for_retry(self) -> None:
        """Forget a refused attempt's response but keep the first send time."""
        self.refused_attempts += 1
        self.status = self.retry_after = self.error = self.done = None

    @property
    def outcome(self) -> str:
        if self.sent is None:
            return "unsent"
        if self.hung:
            return "hung"
        if self.done is None and self.error is None:
            return "in-flight"
        if self.status in REFUSAL_STATUSES and not self.chunk_times:
            return "refused"
        if self.error is None and self.status == 200 and self.done is not None:
            return "ok"
        return "error"

    @property
    def delivery_error_ms(self) -> float | None:
        return None if self.sent is None else (self.sent - self.scheduled) * 1000.0

    @property
    def ttft_ms(self) -> float | None:
        return self.chunk_times[0] * 1000.0 if self.chunk_times else None

    @property
    def e2e_ms(self) -> float | None:
        return self.done * 1000.0 if self.done is not None else None

    @property
    def itl_ms(self) -> list[float]:
        t = self.chunk_times
        return [(b - a) * 1000.0 for a, b in zip(t, t[1:])]

    @property
    def tpot_ms(self) -> float | None:
        n = self.output_tokens
        if not n or n < 2 or self.ttft_ms is None or self.e2e_ms is None:
            return None
        return (self.e2e_ms - self.ttft_ms) / (n - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(outcome=self.outcome, delivery_error_ms=self.delivery_error_ms,
                 ttft_ms=self.ttft_ms, e2e_ms=self.e2e_ms, tpot_ms=self.tpot_ms)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})
