"""One synchronous engine step: build its graph, sample, RETIRE it, release it, record tokens.

Retirement means the sampled tokens and every KV page array are evaluated and the device is idle;
only then are the step's device results dropped and its workspace permits (fused prefill)
returned, so the ledger never refunds bytes the device may still be using. A step that fails is
retried row by row so only the requests that caused the failure fail.
"""
from __future__ import annotations

import logging
import time

import mlx.core as mx
import numpy as np

from engine.runner.paged import SeqChunk
from engine.sampling.sampler import StepLogprobs, row_spec, sample
from engine.sched.seq import Step

log = logging.getLogger("orchard.engine")


class StepExecution:
    """Engine mixin: runs a scheduled step (or hands steady decode to the pipeline)."""

    def _run_step(self, step: Step) -> None:
        if self._pipeline and self._pure_decode(step):
            self._run_pipelined(step)
            return
        t0 = time.perf_counter()
        self._step_id = step.step_id
        self._token_logprobs.clear()   # a row that finished unread (cancelled) left its entry
        mx.reset_peak_memory()   # the release event reports this step's peak (workspace evidence)
        try:
            try:
                tokens = self._forward_and_sample(step.chunks)
            except Exception:  # noqa: BLE001 - isolate the rows that fail; never kill the thread
                tokens = self._isolate_failures(step)
        finally:
            self._step_id = None
        self._retired_step = step.step_id
        self._emit("retire", step=step.step_id)
        self._release_step(step.step_id)
        now = time.monotonic()
        self.scheduler.forecast.observe(step.prefill_tokens, step.decode_rows,
                                        time.perf_counter() - t0)
        self._counters["steps"] += 1
        self._counters["prompt_tokens"] += step.prefill_tokens
        for seq, tok in self.scheduler.complete(step, tokens, now):
            self._counters["generation_tokens"] += 1
            self._deliver(seq, tok)

    def _forward_and_sample(self, chunks) -> list[int | None]:
        """Run one forward, sample the rows that need a token, and RETIRE the step."""
        logits = self.runner.forward([SeqChunk(c.seq.seq_id, c.token_ids, c.start,
                                               c.seq.table.pages) for c in chunks])
        rows = [i for i, c in enumerate(chunks) if c.samples]
        drawn = None
        if rows:
            specs = [row_spec(chunks[i].seq, 0) for i in rows]
            picked = logits if len(rows) == len(chunks) else logits[mx.array(rows)]
            drawn = sample(picked, specs)
            logprobs = StepLogprobs(picked, drawn, specs)
        # Retirement: the tokens and every KV page array are computed and the device is idle.
        mx.eval(drawn if drawn is not None else logits, self.kvstore.arrays(),
                *(logprobs.arrays if rows else ()))
        mx.synchronize()
        self._step_arrays.extend((logits, drawn))
        if rows:
            self._tap([chunks[i] for i in rows], picked)
            for j, lp in logprobs.by_row().items():
                self._token_logprobs[chunks[rows[j]].seq.request_id] = lp
        out: list[int | None] = [None] * len(chunks)
        for i, t in zip(rows, drawn.tolist() if drawn is not None else []):
            out[i] = t
            seq = chunks[i].seq
            if seq.constraint is not None and not seq.constraint.advance(t):
                # The mask allowed only grammar tokens, so this is a library fault: say so.
                log.error("request %s: grammar rejected sampled token %d: %s",
                          seq.request_id, t, seq.constraint.error())
        return out

    def _tap(self, chunks, logits: mx.array) -> None:
        """Hand each sampling row's logits to the tap (rows of `logits` follow `chunks`)."""
        if self._logits_tap is None:
            return
        try:
            for row, c in zip(np.array(logits, copy=True), chunks):
                self._logits_tap(c.seq.request_id, len(c.seq.output_ids), row)
        except Exception:  # noqa: BLE001 - an observer never changes what the engine does
            log.exception("logits tap failed")

    def _isolate_failures(self, step: Step) -> list[int | None]:
        out: list[int | None] = [None] * len(step.chunks)
        for i, c in enumerate(step.chunks):
            try:
                out[i] = self._forward_and_sample([c])[0]
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed in step %d", c.seq.request_id, step.step_id)
                self._fail(c.seq, e)
        mx.synchronize()
        return out

    def _permit(self, nbytes: int) -> bool:
        """Workspace for the step being built, from the byte ledger; refused outside a step."""
        step = self._step_id
        ledger = self.scheduler.ledger
        granted = step is not None and ledger.reserve_workspace(step, nbytes)
        self._emit("permit", step=step, nbytes=nbytes, granted=granted,
                   workspace_bytes=ledger.workspace_bytes,
                   free_bytes=ledger.cost_model.free_bytes(ledger.used_bytes))
        return granted

    def _release_step(self, step_id: int) -> None:
        """After retirement: drop the step's device results, then return its workspace permits.

        MLX active memory is read around dropping the arrays the step still references (its
        logits and sampled ids, and whatever of its graph they keep alive), with the step's peak,
        so a trace shows that the workspace it paid for is no longer allocated when the bytes
        return to the ledger.
        """
        before, peak = mx.get_active_memory(), mx.get_peak_memory()
        self._step_arrays.clear()
        after = mx.get_active_memory()
        nbytes = self.scheduler.ledger.release_workspace(step_id)
        self._emit("release", step=step_id, nbytes=nbytes, active_before=before,
                   active_after=after, peak=peak)
