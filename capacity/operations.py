"""The operations a client batches to the capacity actor, as dataclasses, and their one codec.

On both transports (Ray calls and the direct connection) an operation travels as a plain list,
`[name, field, ...]` in field order, so msgpack and pickle carry the same thing. Trailing fields
at their defaults are left off, so an op that uses no newer field reads as its older form, and
an older client's shorter form decodes with the defaults:

    ["hold", model_id, raw_tokens, request_id, prompt_tokens=None, exclude=(), wait_s=0.0,
     affine=False,     # affine: wait beside the FIFO for the non-excluded replicas only
     saved_tokens=0]   # affine: prompt tokens they cache (the wait: capacity/affine_bound.py)
    ["commit", request_id, replica_id, raw_tokens=None, model_id=None]
    ["release", request_id, telemetry=None]      # RequestTelemetry as its field dict
    ["cancel", request_id]
    ["heartbeat", report]
    ["retire", [replica_id, ...]]     # replicas the serving layer saw go away

`encode_op` is the client's side, `decode_op` the actor's (capacity/ops.py). A field that is a
wire model (capacity/protocol.py) travels as its field dict and is validated back into the model
when the operation is built, so the actor reads the type the replica made. Pure Python.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, ClassVar, Union

from pydantic import BaseModel

from capacity.errors import CapacityError
from capacity.protocol import RequestTelemetry


@dataclass(frozen=True, slots=True)
class HoldOp:
    name: ClassVar[str] = "hold"
    model_id: str
    raw_tokens: int
    request_id: str
    prompt_tokens: int | None = None
    exclude: tuple = ()
    wait_s: float = 0.0
    # The prefix-aware router's wait for the replicas caching the prompt (capacity/waiting.py):
    # on its own list, never ahead of the FIFO's head, refused when wait_s runs out. An actor
    # older than this field rejects such an op as malformed (the router then routes by headroom).
    affine: bool = False
    # Affine only: the prompt tokens the non-excluded replicas cache. The actor bounds the wait by
    # the prefill they save (capacity/affine_bound.py), wait_s capping it; 0 = wait_s as given.
    saved_tokens: int = 0

    def __post_init__(self):
        object.__setattr__(self, "exclude", tuple(self.exclude))   # msgpack sends a list

    def waiting(self, wait_s: float) -> "HoldOp":
        """The same hold, waiting up to `wait_s` at the actor."""
        return replace(self, wait_s=wait_s)


@dataclass(frozen=True, slots=True)
class CommitOp:
    name: ClassVar[str] = "commit"
    request_id: str
    replica_id: str
    raw_tokens: int | None = None    # with model_id: lets a restarted actor re-establish it
    model_id: str | None = None


@dataclass(frozen=True, slots=True)
class ReleaseOp:
    name: ClassVar[str] = "release"
    request_id: str
    telemetry: RequestTelemetry | None = None

    def __post_init__(self):
        if self.telemetry is not None and not isinstance(self.telemetry, RequestTelemetry):
            # The wire form (a dict); a malformed one raises pydantic's ValueError here.
            object.__setattr__(self, "telemetry", RequestTelemetry.model_validate(self.telemetry))


@dataclass(frozen=True, slots=True)
class CancelOp:
    name: ClassVar[str] = "cancel"
    request_id: str


@dataclass(frozen=True, slots=True)
class HeartbeatOp:
    name: ClassVar[str] = "heartbeat"
    report: dict                     # HeartbeatReport's wire form


@dataclass(frozen=True, slots=True)
class RetireOp:
    name: ClassVar[str] = "retire"
    replica_ids: list


Op = Union[HoldOp, CommitOp, ReleaseOp, CancelOp, HeartbeatOp, RetireOp]
OPS: dict[str, type] = {cls.name: cls for cls in (HoldOp, CommitOp, ReleaseOp, CancelOp,
                                                   HeartbeatOp, RetireOp)}


def encode_op(op: Op) -> list:
    """The wire form of an operation: [name, field, ...], trailing defaults left off."""
    values = [getattr(op, f.name) for f in _FIELDS[type(op)]]
    n = len(values)
    while n and _is_default(_FIELDS[type(op)][n - 1], values[n - 1]):
        n -= 1
    return [op.name, *(_plain(v) for v in values[:n])]


def _is_default(f, value: Any) -> bool:
    return f.default is not MISSING and type(value) is type(f.default) and value == f.default


def _plain(value: Any) -> Any:
    """msgpack and pickle carry the same plain data: a wire model goes as its field dict."""
    return value.model_dump() if isinstance(value, BaseModel) else value


def decode_op(raw: Any) -> Op:
    """An operation from its wire form (an Op passes through). Raises TypeError for the wrong
    arity or shape, ValueError for an empty one or a malformed wire model, CapacityError for an
    unknown name."""
    if isinstance(raw, _OP_TYPES):
        return raw
    name, *args = raw
    cls = OPS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CapacityError(f"unknown op {name!r}")
    return cls(*args)


_OP_TYPES = tuple(OPS.values())
_FIELDS = {cls: fields(cls) for cls in _OP_TYPES}
