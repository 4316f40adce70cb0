"""Commands from callers, applied on the engine thread between steps, and request admission.

Callers never touch engine state: `Engine.generate`, `cancel`, `save_checkpoint`,
`evict_prefix_cache` and `shutdown` put commands on the inbox, and the engine thread applies them
only between two steps (a step's graph and its retirement never see a half-applied command).
"""
from __future__ import annotations

import queue
import time

from engine.checkpoint.format import CheckpointError
from engine.sampling.detok import TextStream
from engine.streams import LiveRequest
from engine.errors import (DeadlineUnmeetable, EngineError, EngineOverloaded, EngineShutdown,
                           InvalidRequest, RequestTooLarge)
from engine.sched.seq import Seq


class CommandInbox:
    """Engine mixin: drains `_inbox` (submit, cancel, save, evict) and hooks admission."""

    def _take_commands(self, block: bool, timeout: float | None = None) -> None:
        try:
            cmd = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "submit":
            _, seq, sink = cmd
            try:
                if self._stopping.is_set():
                    raise EngineShutdown("engine is shutting down")
                if seq.request_id in self._live:
                    raise InvalidRequest(f"request id {seq.request_id!r} is already running")
                now = time.monotonic()
                ledger = self.scheduler.ledger
                self._emit("arrival", request=seq.request_id, now=now, deadline=seq.deadline,
                           retired_step=self._retired_step, workspace_bytes=ledger.workspace_bytes,
                           free_bytes=ledger.cost_model.free_bytes(ledger.used_bytes))
                if seq.restore is not None:
                    self._checkpoints.check_restorable(seq)
                self.scheduler.submit(seq, now)
            except EngineError as e:
                if not isinstance(e, (RequestTooLarge, EngineOverloaded, DeadlineUnmeetable)):
                    self._counters[f"refused_{e.reason}"] += 1   # the scheduler counts its own
                sink.put(e, final=True)
                return
            self._seq_ids += 1
            seq.seq_id = self._seq_ids
            self._live[seq.request_id] = LiveRequest(
                seq, sink, TextStream(self.tokenizer, seq.prompt_ids, seq.params.stop))
        elif cmd[0] == "cancel":
            self.scheduler.cancel(cmd[1])
        elif cmd[0] == "save":
            _, request_id, path, done = cmd
            try:
                done.set_result(self._save(request_id, path))
            except Exception as e:  # noqa: BLE001 - reported to the caller, never kills the thread
                done.set_exception(e if isinstance(e, EngineError) else CheckpointError(repr(e)))
        elif cmd[0] == "evict":
            self.scheduler.evict_cache(self.scheduler.pool.num_pages)

    def _on_admit(self, seq: Seq) -> None:
        self._emit("admit", request=seq.request_id, cached_tokens=seq.cached_tokens,
                   charged=self.scheduler.ledger.held(seq.request_id),
                   retired_step=self._retired_step)
        if seq.restore is not None:
            self._restore(seq)

    def _fail_inbox(self, exc: EngineError) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit":
                cmd[2].put(exc, final=True)
            elif cmd[0] == "save":
                cmd[3].set_exception(exc)
