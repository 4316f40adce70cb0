"""What a model replica streams back to the ingress, one item per engine delta.

`ModelServer.generate` (serve_app/server.py) yields a `ReplicaDelta` per coalesced engine delta,
or a single `ReplicaError` when the request fails before its first delta; the ingress
(serve_app/streaming.py) reads them. Plain frozen dataclasses: Ray pickles them as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True, slots=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0       # prompt tokens served from the prefix cache


# One sampled token's logprob and its top alternatives: (logprob, ((token id, logprob), ...)).
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, slots=True)
class ReplicaDelta:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None        # "stop" | "length" | "cancelled" | "deadline" | None
    usage: TokenUsage | None
    ttft_s: float | None = None      # the first delta's engine time to first token
    logprobs: tuple[TokenLogprob, ...] | None = None   # one per token id, when asked for
    replica_id: str | None = None    # the first delta only: the x-orchard-replica header
    trace: dict | None = None        # the first delta only, when tracing (serve_app/calls.py)


@dataclass(frozen=True, slots=True)
class ReplicaError:
    """The request failed before its first delta: APIError's wire form (serve_app/errors.py)."""
    error: dict


ReplicaItem = Union[ReplicaDelta, ReplicaError]
