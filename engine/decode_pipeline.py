"""Pipelined decode: the engine queues decode step n+1 before it reads step n back.

Steady decode (every running request decoding one token, nothing waiting, no command
pending) queues step n+1 with step n's still-lazy sampled tokens before reading step n
back, as mlx-lm's generators do, so building a step's graph overlaps the previous step's
compute. Invariants kept:
- retire-then-refund: step n+1 sets `last_step` of every row it holds, so a request that
  finishes when step n completes (EOS, stop string, cancel by a gone consumer) keeps its
  pages until step n+1 retired; its step n+1 token is discarded (`complete` skips rows
  that are no longer running) and was written to its own, still-held pages.
- max_tokens: step n+1 is built only when every row has >= 2 tokens left, so no row's
  extra step is ever past its reservation and a length finish never wastes a step.
- determinism: a row's sampling key is (seed, token index) as in a synchronous step.
- commands (submit, cancel, save, evict, shutdown) are applied only between steps: a
  pending one stops the pipeline, the in-flight step retires, and the main loop runs.
- failures: a step that fails to build or to evaluate drains the pipeline; the failed
  step is retried row by row as usual and the queued one is retired without results.
"""
from __future__ import annotations

import logging
import time

import mlx.core as mx

from engine.runner.paged import SeqChunk
from engine.sampling.sampler import row_spec, sample
from engine.sched.seq import RUNNING, Step

log = logging.getLogger("orchard.engine")


class InFlightStep:
    """A queued (pipelined) decode step and its lazy results."""

    __slots__ = ("step", "logits", "drawn")

    def __init__(self, step: Step, logits, drawn):
        self.step, self.logits, self.drawn = step, logits, drawn


class DecodePipeline:
    """Engine mixin: runs steady decode steps two at a time (one computing, one being built).

    `pipeline_decode` (class attribute of Engine) switches it off, e.g. for tests that compare
    pipelined and synchronous runs; `_start` decides whether this engine may pipeline at all.
    """

    def _pure_decode(self, step: Step) -> bool:
        # Rows with penalties or logprobs sample from an up-to-date history and read their
        # logprobs back every step: such a step runs synchronously.
        return all(c.samples and len(c.token_ids) == 1 and not c.seq.prefilling
                   and not c.seq.params.synchronous for c in step.chunks)

    def _may_continue(self, step: Step) -> bool:
        """Whether the decode step after `step` may be queued before `step` is read back."""
        sch = self.scheduler
        if (sch.waiting or len(sch.running) != len(step.chunks) or not self._inbox.empty()
                or self._stopping.is_set()):
            return False
        for c in step.chunks:
            s = c.seq
            if (s.status != RUNNING or len(s.output_ids) + 2 > s.params.max_tokens
                    or s.checkpoint_to is not None):
                return False
        return True

    def _launch(self, step: Step, ahead: int) -> InFlightStep:
        """Build a decode step's graph and queue it (mx.async_eval); `ahead` = 1 when the
        previous step's tokens are not yet in `output_ids` (they are this step's inputs)."""
        self._step_id = step.step_id
        try:
            chunks = step.chunks
            logits = self.runner.forward([SeqChunk(c.seq.seq_id, c.token_ids, c.start,
                                                   c.seq.table.pages) for c in chunks],
                                         decode_tokens=step.inputs)
            drawn = sample(logits, [row_spec(c.seq, ahead) for c in chunks])
            mx.async_eval(drawn, self.kvstore.arrays())
        finally:
            self._step_id = None
        return InFlightStep(step, logits, drawn)

    def _run_pipelined(self, step: Step) -> None:
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        try:
            cur = self._launch(step, 0)
        except Exception:  # noqa: BLE001 - the synchronous path isolates the failing rows
            cur = InFlightStep(step, None, None)
        while cur is not None:
            nxt = None
            if cur.drawn is not None and self._may_continue(cur.step):
                ahead = self.scheduler.continue_decode(cur.step, cur.drawn)
                try:
                    nxt = self._launch(ahead, 1)
                except Exception:  # noqa: BLE001 - retired below without results
                    log.exception("pipelined step %d failed to build", ahead.step_id)
                    nxt = InFlightStep(ahead, None, None)
            tokens = None
            if cur.drawn is not None:
                try:
                    tokens = cur.drawn.tolist()   # waits for this step only; nxt stays queued
                except Exception:  # noqa: BLE001
                    tokens = None
            if tokens is not None:
                self._tap(cur.step.chunks, cur.logits)
            else:   # drain, then retry this step row by row (the retry taps its own rows)
                if nxt is not None:
                    self._discard(nxt)
                    nxt = InFlightStep(nxt.step, None, None)
                self._step_id = cur.step.step_id
                try:
                    tokens = self._isolate_failures(cur.step)
                finally:
                    self._step_id = None
            if nxt is None:
                # The last step of the run: the device goes idle, as in a synchronous step.
                try:
                    mx.eval(self.kvstore.arrays())
                except Exception:  # noqa: BLE001 - never kill the thread; later steps fail rows
                    log.exception("KV arrays failed to evaluate after step %d", cur.step.step_id)
                mx.synchronize()
            cur.logits = cur.drawn = None
            self._finish_step(cur.step, tokens, t0)
            t0 = time.perf_counter()
            if nxt is not None and nxt.drawn is None:   # failed or drained: no results
                self._finish_step(nxt.step, [None] * len(nxt.step.chunks), t0, count=False)
                nxt = None
            if nxt is not None:
                self._between_steps()
            cur = nxt

    def _discard(self, flight: InFlightStep) -> None:
        try:
            mx.eval(flight.drawn)
        except Exception:  # noqa: BLE001 - its results are dropped anyway
            pass
        mx.synchronize()

    def _finish_step(self, step: Step, tokens: list[int | None], t0: float,
                     count: bool = True) -> None:
        """Retire a pipelined step (its results are read), release it, record its tokens."""
        self._retired_step = step.step_id
        self._emit("retire", step=step.step_id)
        self._release_step(step.step_id)
        if not count:
            return
        now = time.monotonic()
        self.scheduler.forecast.observe(0, len(step.chunks), time.perf_counter() - t0)
        self._counters["steps"] += 1
        for seq, tok in self.scheduler.complete(step, tokens, now):
            self._counters["generation_tokens"] += 1
            self._deliver(seq, tok)

    def _between_steps(self) -> None:
        """What the main loop does after a step, for a step retired inside the pipeline."""
        self._close_finished()
        self._reclaim()
        self._publish_stats()
        self._flush_outbox()
