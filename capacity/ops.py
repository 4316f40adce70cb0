"""The capacity actor's one batch path, shared by both transports (Ray calls and the direct
connection), without Ray: a batch of operations (capacity/operations.py, decoded here from
their wire form) applied in order against a Fleet.

A hold's result is {"ok": True, "hold": Hold} or refusal data; a hold with wait_s > 0 that finds
no room yields a future of the same (capacity/waiting.py), and every other op that may have made
room (all but hold) lets the waiters in first, before the next op of the batch runs. An op that
fails yields {"error": ..., "detail": ...} without failing its batch-mates.
"""
from __future__ import annotations

import time
from typing import Any

from capacity.errors import CapacityError
from capacity.fleet import Fleet
from capacity.operations import (CancelOp, CommitOp, HeartbeatOp, HoldOp, Op, ReleaseOp,
                                 RetireOp, decode_op)
from capacity.waiting import WaitQueues


class BatchOps:
    def __init__(self, fleet: Fleet, clock=time.monotonic):
        self.fleet = fleet
        self.clock = clock
        self.waits = WaitQueues(fleet, clock)
        self.batches = 0
        self.ops = 0

    def apply(self, ops: list, owner: object | None = None) -> list:
        """`owner`: the direct connection the batch came on (its waiters end with it)."""
        self.batches += 1
        self.ops += len(ops)
        out = []
        for op in ops:
            try:
                out.append(self._apply_one(decode_op(op), owner))
            except CapacityError as e:       # one bad report must not fail its batch-mates
                out.append({"error": type(e).__name__, "detail": str(e)})
            except ValueError as e:          # pydantic validation of a malformed report
                out.append({"error": "ValidationError", "detail": str(e)[:500]})
            except (TypeError, IndexError) as e:   # wrong arity or shape (direct clients)
                out.append({"error": "MalformedOp", "detail": str(e)[:500]})
        return out

    def expire(self) -> int:
        gone = self.fleet.expire(self.clock())
        if gone and len(self.waits):
            self.waits.drain()
        return gone

    def _apply_one(self, op: Op, owner: object | None) -> Any:
        if isinstance(op, HoldOp):
            return self._hold(op, owner)
        now = self.clock()
        if isinstance(op, CommitOp):
            out = self.fleet.commit(op.request_id, op.replica_id, now, op.raw_tokens, op.model_id)
        elif isinstance(op, ReleaseOp):
            out = self.fleet.release(op.request_id, op.telemetry)
        elif isinstance(op, CancelOp):
            out = self.fleet.cancel(op.request_id)
            known = out or self.fleet.ledger.outcome(op.request_id) is not None
            out = self.waits.cancel(op.request_id, known) or out
        elif isinstance(op, HeartbeatOp):
            out = self.fleet.heartbeat(op.report, now)
        elif isinstance(op, RetireOp):
            out = self.fleet.retire(list(op.replica_ids))
        else:
            raise CapacityError(f"unknown op {op!r}")
        if len(self.waits):          # anything but a hold may have made room for a waiter
            self.waits.drain()
        return out

    def _hold(self, op: HoldOp, owner):
        """Refusals come back as data, not exceptions: cheaper, and no RayTaskError unwrapping."""
        return self.waits.hold(op, owner)
