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
    min_tokens: int = 0   # EOS / stop ids held back until this many tokens (vLLM's extension)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None   # None = off; k = the sampled token's logprob + k alternatives
    grammar: str | None = None   # structured output / forced tool call: an llguidance grammar
    tenant: str | None = None   # prefix-cache namespace (one per API key; None = shared)
    # Wall-clock (time.time()) deadline: monotonic clocks differ between processes and nodes.
    first_token_deadline_unix: float | None = None
    # Debug only (ORCHARD_TRACE=1): hop name -> time.time(), filled along the path.
    trace: dict | None = None

    @property
    def raw_tokens(self) -> int:
        """Prompt + max tokens, as the user asked: the unit budgets and holds are priced in."""
        return len(self.prompt_ids) + self.max_tokens

    def sampling_params(self):
        """The engine's SamplingParams for this call (raises engine InvalidRequest)."""
        from engine.sampling.params import SamplingParams

        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=self.max_tokens, stop=tuple(self.stop), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(self.logit_bias.items()), stop_token_ids=tuple(self.stop_token_ids),
            logprobs=self.logprobs, grammar=self.grammar)

    def deadline_monotonic(self) -> float | None:
        if self.first_token_deadline_unix is None:
            return None
        return time.monotonic() + (self.first_token_deadline_unix - time.time())
