"""Sampling parameters of one request, validated when built (a bad value is an InvalidSampling
naming its field).

This is the one home of each field's range: the ingress builds these (pure Python, no MLX) and
hands them through to the engine unchanged; the HTTP layer checks only the wire's shape and
OpenAI-only rules. The batched sampler that applies them is engine/sampling/sampler.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequest

MAX_LOGPROBS = 20   # alternatives per token (OpenAI's top_logprobs limit)
# The engine's bound on per-step stop matching; HTTP refuses more than OpenAI's 4 before this.
MAX_STOP_STRINGS = 16


class InvalidSampling(InvalidRequest):
    """A sampling value out of its declared range; `param` names the field, so the ingress's 400
    names it too."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 = greedy
    top_p: float = 1.0         # nucleus mass kept; 1 = off
    top_k: int = 0             # keep the k most likely tokens; 0 = off
    seed: int | None = None    # None: the engine draws one per request
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)  # never emitted; the match ends the text
    ignore_eos: bool = False
    min_p: float = 0.0              # keep tokens with p >= min_p * p(top token); 0 = off
    presence_penalty: float = 0.0   # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of seen tokens
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    stop_token_ids: tuple[int, ...] = ()   # finish with "stop" when sampled (never decoded)
    logprobs: int | None = None     # None = off; k = the sampled token's logprob + k alternatives
    grammar: str | None = None      # llguidance grammar the output must match (structured.py)
    # vLLM's extension: EOS and stop_token_ids are masked out of the logits (and stop strings
    # not matched) until this many tokens have been generated; benchmarks use it to fix lengths.
    min_tokens: int = 0
    # The model's end-of-sequence ids: the engine fills them in at submit (Engine.generate), so
    # the sampler can hold them back for min_tokens without knowing the tokenizer.
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias",
                           tuple((t, float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        # Messages are the ingress's 400s word for word: clients see them.
        _require(_is_num(self.temperature) and 0.0 <= self.temperature <= 2.0,
                 f"temperature must be in [0, 2], got {self.temperature!r}", "temperature")
        _require(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
                 f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        _require(_is_int(self.top_k) and self.top_k >= 0,
                 f"top_k must be >= 0, got {self.top_k!r}", "top_k")
        _require(self.seed is None or _is_int(self.seed), f"seed must be an int, got {self.seed!r}",
                 "seed")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 f"max_tokens must be >= 1, got {self.max_tokens!r}", "max_tokens")
        _require(all(isinstance(s, str) and s for s in self.stop),
                 "stop must be non-empty strings", "stop")
        _require(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings",
                 "stop")
        _require(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
                 f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _require(_is_num(v) and -2.0 <= v <= 2.0, f"{name} must be in [-2, 2], got {v!r}",
                     name)
        _require(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
                 f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}",
                 "repetition_penalty")
        _require(all(_is_int(t) and t >= 0 for t, _ in self.logit_bias),
                 "logit_bias keys must be token ids >= 0", "logit_bias")
        bad = next((b for _, b in self.logit_bias
                    if not (math.isfinite(b) and -100.0 <= b <= 100.0)), None)
        _require(bad is None, f"logit_bias values must be in [-100, 100], got {bad!r}",
                 "logit_bias")
        _require(len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
                 "logit_bias names a token id twice", "logit_bias")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids must be token ids >= 0", "stop_token_ids")
        _require(self.grammar is None or (isinstance(self.grammar, str) and self.grammar),
                 "grammar must be a non-empty llguidance grammar", "grammar")
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                 f"min_tokens must be in [0, {self.max_tokens!r}], got {self.min_tokens!r}",
                 "min_tokens")
        # A grammar's document ends where the grammar says (only EOS is allowed then): forcing
        # more tokens would leave a row with no token it may take.
        _require(not (self.min_tokens and self.grammar is not None),
                 "min_tokens cannot be combined with a grammar (structured output)", "min_tokens")
        _require(all(_is_int(t) and t >= 0 for t in self.eos_token_ids),
                 "eos_token_ids must be token ids >= 0", "eos_token_ids")
        _require(self.logprobs is None or (_is_int(self.logprobs)
                                           and 0 <= self.logprobs <= MAX_LOGPROBS),
                 f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                 "logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Needs the request's token history (penalties)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def processes_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias)

    @property
    def held_back_ids(self) -> tuple[int, ...]:
        """Token ids masked while fewer than min_tokens were generated: those that would end
        the sequence (EOS only when it ends it, i.e. without ignore_eos)."""
        if not self.min_tokens:
            return ()
        ends = (() if self.ignore_eos else self.eos_token_ids) + self.stop_token_ids
        return tuple(sorted(set(ends)))

    @property
    def synchronous(self) -> bool:
        """Sampled from an up-to-date history or grammar state, or read back with logprobs every
        step, so a decode step holding such a row is not pipelined (engine/steps.py)."""
        return self.penalized or self.logprobs is not None or self.grammar is not None

    def token_ids_used(self) -> list[int]:
        """Token ids this request names (checked against the vocabulary at submit)."""
        return [t for t, _ in self.logit_bias] + list(self.stop_token_ids)


@dataclass(frozen=True)
class TokenLogprob:
    """What a request with `logprobs` gets per token: the sampled token's log-probability and
    the `k` most likely alternatives (id, logprob). Pure data: it crosses Ray in a Delta."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidSampling(message, param)
