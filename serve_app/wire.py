"""What a model replica streams back to the ingress, one item per engine delta.

`ModelServer.generate` (serve_app/server.py) yields a `ReplicaDelta` per coalesced engine delta:
the engine's own `Delta` (engine/request.py, pure Python: the ingress never imports MLX) plus
the facts only the first carries; or a single `ReplicaError` when the request fails before its
first delta. The ingress (serve_app/streaming.py) reads them. Plain frozen dataclasses: Ray
pickles them as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from engine.request import Delta


@dataclass(frozen=True, slots=True)
class ReplicaDelta:
    delta: Delta                     # as the engine streamed it (coalesced)
    replica_id: str | None = None    # the first delta only: the x-orchard-replica header
    trace: dict | None = None        # the first delta only, when tracing (serve_app/calls.py)


@dataclass(frozen=True, slots=True)
class ReplicaError:
    """The request failed before its first delta: APIError's wire form (serve_app/errors.py)."""
    error: dict


ReplicaItem = Union[ReplicaDelta, ReplicaError]
