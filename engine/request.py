"""What callers hand the engine and what it streams back (plain data, validated on the caller's
thread so a bad input never reaches the engine thread)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequest
from engine.sampling.params import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "deadline", "error")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    first_token_deadline: float | None = None  # absolute time.monotonic() seconds
    tenant: str | None = None   # prefix-cache namespace; None = the engine's configured tenant
    # A checkpoint directory (Engine.save_checkpoint) whose KV rows cover the first tokens of
    # prompt_ids: they are restored verbatim instead of computed; at least one token must remain.
    restore_from: str | None = None
    # Save the request's KV to this directory when it finishes (its final delta carries the
    # manifest): the finished-request form of Engine.save_checkpoint.
    checkpoint_to: str | None = None

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequest("request_id must be a non-empty string")
        if not self.prompt_ids:
            raise InvalidRequest("prompt_ids must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.prompt_ids):
            raise InvalidRequest("prompt_ids must be non-negative integers")
        if self.tenant is not None and (not isinstance(self.tenant, str) or not self.tenant):
            raise InvalidRequest("tenant must be a non-empty string when given")
        if not isinstance(self.params, SamplingParams):
            raise InvalidRequest("params must be a SamplingParams")
        object.__setattr__(self, "prompt_ids", list(self.prompt_ids))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Delta:
    """One streamed step of a request: new text and tokens; the last one has a finish_reason."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    ttft_s: float | None = None  # on the first delta only: seconds from submit to first token
    checkpoint: dict | None = None  # final delta of a checkpoint_to request: manifest or error
    # Requests with params.logprobs: one sampling.params.TokenLogprob per token of token_ids.
    logprobs: list | None = None


def merge_deltas(a: Delta, b: Delta) -> Delta:
    """`a` then `b` as one delta (b later): text and tokens joined, b's finish and usage."""
    logprobs = None if a.logprobs is None and b.logprobs is None \
        else [*(a.logprobs or ()), *(b.logprobs or ())]
    return Delta(a.request_id, a.text + b.text, [*a.token_ids, *b.token_ids], b.finish_reason,
                 b.usage, a.ttft_s if a.ttft_s is not None else b.ttft_s,
                 b.checkpoint if b.checkpoint is not None else a.checkpoint, logprobs)

