"""Checkpoints of the engine's requests: validate at submit, restore at admission, save on
command or at finish.

The file format and its checks live in engine/checkpoint/format.py; this binds them to one engine's
store, model fingerprint and HMAC key, and decides how a failure is reported: a restore that fails
fails only its request, a save on command reports to its caller, a save at finish goes into the
final delta. Runs on the engine thread only, between steps (the rows it reads have retired).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from engine.checkpoint.format import (CheckpointError, check_compatible, read_manifest,
                               restore_checkpoint, save_checkpoint)
from engine.sched.seq import Seq

log = logging.getLogger("orchard.engine")


@dataclass
class RequestCheckpoints:
    model_id: str
    kvstore: Any
    fingerprint: str
    key: bytes | None
    page_tokens: int
    has_recurrent_state: bool

    def check_restorable(self, seq: Seq) -> None:
        """Refuse a bad checkpoint at submit, before anything is charged or allocated."""
        if self.has_recurrent_state:
            raise CheckpointError(f"{self.model_id}: recurrent layers keep state outside the "
                                  "pages; their requests cannot be restored")
        manifest = read_manifest(seq.restore, self.key)
        check_compatible(manifest, self.kvstore, self.fingerprint, seq.prompt_ids)
        if manifest["num_tokens"] >= len(seq.prompt_ids):
            raise CheckpointError("the checkpoint covers the whole prompt; append at least the "
                                  "next token so there is one to compute")

    def restore(self, seq: Seq) -> int:
        """Write the checkpoint's rows into the admitted request's first pages (re-validated
        first: nothing is allocated for a file that changed since submit); tokens restored."""
        _, n = restore_checkpoint(
            seq.restore, self.kvstore, seq.prompt_ids, model_fingerprint=self.fingerprint,
            key=self.key, allocate=lambda pages: seq.table.ensure(pages * self.page_tokens))
        return n

    def save(self, seq: Seq, path: str) -> dict:
        """Save the request's computed KV (its steps must have retired)."""
        return save_checkpoint(path, self.kvstore, seq.table.pages,
                               [seq.token_at(i) for i in range(seq.num_computed)],
                               model_fingerprint=self.fingerprint, key=self.key)

    def restore_admitted(self, seq: Seq) -> CheckpointError | None:
        """Restore an admitted request's checkpoint; the error that fails it, if any."""
        try:
            n = self.restore(seq)
        except Exception as e:  # noqa: BLE001 - fails this request only
            return e if isinstance(e, CheckpointError) else CheckpointError(repr(e))
        seq.num_computed = seq.cached_tokens = n
        return None

    def save_running(self, running: Iterable[Seq], request_id: str, path: str) -> dict:
        """Save a running request's computed KV on its caller's command (between steps)."""
        seq = next((s for s in running if s.request_id == request_id), None)
        if seq is None or seq.num_computed == 0:
            raise CheckpointError(f"request {request_id!r} is not running with computed KV; "
                                  "only a running request's KV can be saved")
        return self.save(seq, path)

    def save_finished(self, seq: Seq) -> dict:
        """Save a finished request's KV before its pages are reclaimed (its steps retired)."""
        if seq.table is None or seq.num_computed == 0:
            return {"error": "the request finished before any of its KV was computed"}
        try:
            return self.save(seq, seq.checkpoint_to)
        except Exception as e:  # noqa: BLE001 - the request itself finished fine
            log.exception("checkpoint of %s failed", seq.request_id)
            return {"error": f"checkpoint failed: {e!r}"}


def save_command(request_id: str, path) -> Callable[[Any], dict]:
    """Engine.save_checkpoint's work, a function of the engine's parts (run between steps)."""
    return lambda parts: parts.checkpoints.save_running(parts.scheduler.running, request_id,
                                                        str(path))
