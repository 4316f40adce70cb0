"""What a model replica streams back to the ingress, one item per engine delta.

`ModelServer.generate` (serve_app/server.py) yields a `ReplicaDelta` per coalesced engine delta:
the engine's own `Delta` (engine/request.py, pure Python: the ingress never imports MLX) plus
the facts only the first carries; or a single `ReplicaError` when the request fails before its
first delta. The ingress (serve_app/streaming.py) reads them. Plain frozen dataclasses.

Across Ray they travel as bytes (`encode` on the replica, `decode` in RayBackend): Ray serializes
a yielded object with cloudpickle on a worker thread of the replica's process, which holds the
GIL the engine thread needs every step; bytes skip that (Ray passes them through msgpack) and
the standard library's C pickler is about 3x cheaper than cloudpickle for these items. At batch
1 on the H200 that serialization was ~3 % of the replica's wall time under the GIL, one item
per token (serve_profile run 9, docs/lab/benchmarks-serve-gpu.md).
"""
from __future__ import annotations

import pickle
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


def encode(item: ReplicaItem) -> bytes:
    """A replica item as the bytes it crosses Ray as (both ends run this project's code)."""
    return pickle.dumps(item, protocol=5)


def decode(data: bytes) -> ReplicaItem:
    """The item `encode` made: only ever bytes from this project's own replicas."""
    return pickle.loads(data)
