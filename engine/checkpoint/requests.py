"""Checkpoints of the engine's requests: validate, restore into an admitted request, save.

The file format and its checks live in engine/checkpoint/format.py; this binds them to one engine's
store, model fingerprint and HMAC key. Runs on the engine thread only (it touches KV pages).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.checkpoint.format import (CheckpointError, check_compatible, read_manifest,
                               restore_checkpoint, save_checkpoint)
from engine.sched.seq import Seq


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
