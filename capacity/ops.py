"""The capacity actor's one batch path, shared by both transports (Ray calls and the direct
connection), without Ray: a batch of (op, args...) applied in order against a Fleet.

    ("hold", model_id, raw_tokens, request_id, prompt_tokens=None, exclude=(), wait_s=0.0)
    ("commit", request_id, replica_id, raw_tokens=None, model_id=None)
    ("release", request_id, telemetry=None)
    ("cancel", request_id)
    ("heartbeat", report)
    ("retire", [replica_id, ...])     # replicas the serving layer saw go away

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
                name, *args = op
                out.append(self._apply_one(name, args, owner))
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

    def _apply_one(self, op: str, args: list, owner: object | None) -> Any:
        if op == "hold":
            return self._hold(owner, *args)
        now = self.clock()
        if op == "commit":
            out = self.fleet.commit(args[0], args[1], now, *args[2:])
        elif op == "release":
            out = self.fleet.release(args[0], args[1] if len(args) > 1 else None)
        elif op == "cancel":
            out = self.fleet.cancel(args[0])
            known = out or self.fleet.ledger.outcome(args[0]) is not None
            out = self.waits.cancel(args[0], known) or out
        elif op == "heartbeat":
            out = self.fleet.heartbeat(args[0], now)
        elif op == "retire":
            out = self.fleet.retire(list(args[0]))
        else:
            raise CapacityError(f"unknown op {op!r}")
        if len(self.waits):          # anything but a hold may have made room for a waiter
            self.waits.drain()
        return out

    def _hold(self, owner, model_id, raw_tokens, request_id, prompt_tokens=None, exclude=(),
              wait_s=0.0):
        """Refusals come back as data, not exceptions: cheaper, and no RayTaskError unwrapping."""
        return self.waits.hold(model_id, raw_tokens, request_id, prompt_tokens, tuple(exclude),
                               float(wait_s or 0.0), owner)
