"""Admission while the capacity actor is unreachable: a conservative per-model cap, kept locally.

An actor outage degrades admission (at most `cap` requests per model in flight through this
client), never serving. Such holds rank no replicas and are settled here, never at the actor.
Pure Python.
"""
from __future__ import annotations

from capacity.errors import CapacityRefused
from capacity.fleet import Hold


class LocalAdmissions:
    def __init__(self, cap: int, retry_after_s: float):
        self.cap = cap
        self.retry_after_s = retry_after_s
        self._held: dict[str, set[str]] = {}     # model -> request ids admitted locally

    def hold(self, model_id: str, raw_tokens: int, request_id: str) -> Hold:
        held = self._held.setdefault(model_id, set())
        if request_id not in held and len(held) >= self.cap:
            raise CapacityRefused("capacity_unavailable", self.retry_after_s,
                                  f"actor unreachable; local cap {self.cap} reached")
        held.add(request_id)
        return Hold(request_id, model_id, "", [], raw_tokens, 0.0, fallback=True)

    def holds(self, request_id: str) -> bool:
        return any(request_id in held for held in self._held.values())

    def settle(self, request_id: str) -> bool:
        """Forget a local hold (commit needs nothing; release/cancel end it): True if it was one."""
        for held in self._held.values():
            if request_id in held:
                held.discard(request_id)
                return True
        return False
