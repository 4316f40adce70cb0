"""The engine's side of request checkpoints: restore at admission, save on command or at finish.

What is written and checked lives in engine/checkpoint/format.py and engine/checkpoint/requests.py;
this decides when, and how a failure is reported: a restore that fails fails only its request,
a save on command reports to its caller, a save at finish goes into the final delta.
"""
from __future__ import annotations

import logging

from engine.checkpoint.format import CheckpointError
from engine.sched.seq import Seq

log = logging.getLogger("orchard.engine")


class CheckpointHooks:
    """Engine mixin: runs on the engine thread, between steps (the rows it reads have retired)."""

    def _restore(self, seq: Seq) -> None:
        try:
            n = self._checkpoints.restore(seq)
        except Exception as e:  # noqa: BLE001 - fails this request only
            self.scheduler.finish(seq, "error")
            live = self._live.pop(seq.request_id, None)
            if live is not None:
                live.sink.put(e if isinstance(e, CheckpointError) else CheckpointError(repr(e)),
                              final=True)
            return
        seq.num_computed = seq.cached_tokens = n

    def _save(self, request_id: str, path: str) -> dict:
        seq = next((s for s in self.scheduler.running if s.request_id == request_id), None)
        if seq is None or seq.num_computed == 0:
            raise CheckpointError(f"request {request_id!r} is not running with computed KV; "
                                  "only a running request's KV can be saved")
        return self._checkpoints.save(seq, path)

    def _save_finished(self, seq: Seq) -> dict:
        """Save a finished request's KV before its pages are reclaimed (its steps retired)."""
        if seq.table is None or seq.num_computed == 0:
            return {"error": "the request finished before any of its KV was computed"}
        try:
            return self._checkpoints.save(seq, seq.checkpoint_to)
        except Exception as e:  # noqa: BLE001 - the request itself finished fine
            log.exception("checkpoint of %s failed", seq.request_id)
            return {"error": f"checkpoint failed: {e!r}"}
