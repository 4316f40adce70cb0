"""The step runner: build a step's graph, sample, RETIRE it, release it, record its tokens.

Retirement means the sampled tokens and every KV page array are evaluated and the device is idle;
only then are the step's device results dropped and its workspace permits (fused prefill)
returned, so the ledger never refunds bytes the device may still be using. A step that fails is
retried row by row so only the requests that caused the failure fail.

Two ways to run a step, one way to finish it (`_finish`: retire, release, observe the rate,
count, complete the scheduler's rows, deliver the tokens):
- synchronous (`run`): build, evaluate, synchronize, finish;
- pipelined steady decode: every running request decoding one token, nothing waiting, no
  command pending. Step n+1 is queued with step n's still-lazy sampled tokens before step n is
  read back, as mlx-lm's generators do, so building a step's graph overlaps the previous
  step's compute. Invariants kept:
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
from collections import Counter
from typing import Callable

import mlx.core as mx
import numpy as np

from engine.runner.paged import SeqChunk
from engine.sampling.sampler import StepLogprobs, row_spec, sample
from engine.sched.seq import RUNNING, Step

log = logging.getLogger("orchard.engine")

Emit = Callable[..., None]


class WorkspacePermits:
    """Workspace for the step whose graph is being built (fused prefill), from the byte ledger.

    A packed layer asks `permit(nbytes)` while the step's graph is built; the bytes are charged
    to that step and returned by `release` right after the step retired (never when a request is
    cancelled: the permit belongs to the step, not to the request). The store is built before
    the scheduler, so its ledger is attached afterwards (`ledger`).
    """

    def __init__(self, emit: Emit):
        self._emit = emit
        self.ledger = None                   # the scheduler's ByteLedger, once it exists
        self.step_id: int | None = None      # the step whose graph is being built
        self.arrays: list = []               # its device results, dropped when it is released

    def permit(self, nbytes: int) -> bool:
        """Workspace for the step being built; refused outside a step."""
        step, ledger = self.step_id, self.ledger
        granted = step is not None and ledger.reserve_workspace(step, nbytes)
        self._emit("permit", step=step, nbytes=nbytes, granted=granted,
                   workspace_bytes=ledger.workspace_bytes,
                   free_bytes=ledger.cost_model.free_bytes(ledger.used_bytes))
        return granted

    def release(self, step_id: int) -> None:
        """After retirement: drop the step's device results, then return its workspace permits.

        MLX active memory is read around dropping the arrays the step still references (its
        logits and sampled ids, and whatever of its graph they keep alive), with the step's peak,
        so a trace shows that the workspace it paid for is no longer allocated when the bytes
        return to the ledger.
        """
        before, peak = mx.get_active_memory(), mx.get_peak_memory()
        self.arrays.clear()
        after = mx.get_active_memory()
        nbytes = self.ledger.release_workspace(step_id)
        self._emit("release", step=step_id, nbytes=nbytes, active_before=before,
                   active_after=after, peak=peak)


class InFlightStep:
    """A queued (pipelined) decode step and its lazy results."""

    __slots__ = ("step", "logits", "drawn")

    def __init__(self, step: Step, logits, drawn):
        self.step, self.logits, self.drawn = step, logits, drawn


class StepRunner:
    """Runs scheduled steps on the engine thread; `retired_step` is the last one retired.

    `quiet()` says whether the loop has nothing to apply (no command pending, not stopping): a
    pipeline continues only then. `between_steps()` is what the loop does after a step, for a
    step retired inside the pipeline. `pipeline`: whether steady decode may be pipelined at all.
    """

    def __init__(self, *, runner, kvstore, scheduler, streams, permits: WorkspacePermits,
                 counters: Counter, emit: Emit, pipeline: bool, quiet: Callable[[], bool],
                 between_steps: Callable[[], None],
                 logits_tap: Callable[[str, int, np.ndarray], None] | None = None):
        self.runner, self.kvstore, self.scheduler = runner, kvstore, scheduler
        self.streams, self.permits, self.counters = streams, permits, counters
        self._emit, self.pipeline = emit, pipeline
        self._quiet, self._between_steps, self._logits_tap = quiet, between_steps, logits_tap
        self.retired_step = -1

    def run(self, step: Step) -> None:
        if self.pipeline and _pure_decode(step):
            self._run_pipelined(step)
            return
        t0 = time.perf_counter()
        self.streams.clear_logprobs()   # a row that finished unread (cancelled) left its entry
        mx.reset_peak_memory()   # the release event reports this step's peak (workspace evidence)
        try:
            tokens = self._forward_and_sample(step.chunks, step.step_id)
        except Exception:  # noqa: BLE001 - isolate the rows that fail; never kill the thread
            tokens = self._isolate_failures(step)
        self._finish(step, tokens, t0)

    # ---- the one finish path ---------------------------------------------------------------

    def _finish(self, step: Step, tokens: list[int | None], t0: float,
                count: bool = True) -> None:
        """Retire a step (its results are read), release it, record its tokens. `count=False`:
        a pipelined step drained without results (retired and released, nothing recorded)."""
        self.retired_step = step.step_id
        self._emit("retire", step=step.step_id)
        self.permits.release(step.step_id)
        if not count:
            return
        now = time.monotonic()
        seconds = time.perf_counter() - t0
        self.scheduler.forecast.observe(step.prefill_tokens, step.decode_rows, seconds)
        compiled = self.runner.compiled
        # Model calls and traces so far (totals): per-step work shows in their differences.
        self._emit("step", step=step.step_id, prefill_tokens=step.prefill_tokens,
                   decode_rows=step.decode_rows, seconds=seconds,
                   model_calls=self.runner.model_calls,
                   traces=compiled.traces if compiled is not None else 0)
        self.counters["steps"] += 1
        self.counters["prompt_tokens"] += step.prefill_tokens
        for seq, tok in self.scheduler.complete(step, tokens, now):
            self.counters["generation_tokens"] += 1
            self.streams.deliver(seq, tok)

    # ---- synchronous steps -----------------------------------------------------------------

    def _forward_and_sample(self, chunks, step_id: int) -> list[int | None]:
        """Run one forward, sample the rows that need a token, and RETIRE the step."""
        self.permits.step_id = step_id
        try:
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
        finally:
            self.permits.step_id = None
        self.permits.arrays.extend((logits, drawn))
        if rows:
            self._tap([chunks[i] for i in rows], picked)
            for j, lp in logprobs.by_row().items():
                self.streams.note_logprobs(chunks[rows[j]].seq.request_id, lp)
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
                out[i] = self._forward_and_sample([c], step.step_id)[0]
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed in step %d", c.seq.request_id, step.step_id)
                self.streams.fail(c.seq, e)
        mx.synchronize()
        return out

    # ---- pipelined steady decode -----------------------------------------------------------

    def _may_continue(self, step: Step) -> bool:
        """Whether the decode step after `step` may be queued before `step` is read back."""
        sch = self.scheduler
        if sch.waiting or len(sch.running) != len(step.chunks) or not self._quiet():
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
        self._emit("launch", step=step.step_id, ahead=ahead,
                   requests={c.seq.request_id for c in step.chunks})
        self.permits.step_id = step.step_id
        try:
            chunks = step.chunks
            logits = self.runner.forward([SeqChunk(c.seq.seq_id, c.token_ids, c.start,
                                                   c.seq.table.pages) for c in chunks],
                                         decode_tokens=step.inputs)
            drawn = sample(logits, [row_spec(c.seq, ahead) for c in chunks])
            mx.async_eval(drawn, self.kvstore.arrays())
        finally:
            self.permits.step_id = None
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
                    _discard(nxt)
                    nxt = InFlightStep(nxt.step, None, None)
                tokens = self._isolate_failures(cur.step)
            if nxt is None:
                # The last step of the run: the device goes idle, as in a synchronous step.
                try:
                    mx.eval(self.kvstore.arrays())
                except Exception:  # noqa: BLE001 - never kill the thread; later steps fail rows
                    log.exception("KV arrays failed to evaluate after step %d", cur.step.step_id)
                mx.synchronize()
            # Its device results are dropped inside the release, as a synchronous step's are.
            self.permits.arrays.extend(a for a in (cur.logits, cur.drawn) if a is not None)
            cur.logits = cur.drawn = None
            self._finish(cur.step, tokens, t0)
            t0 = time.perf_counter()
            if nxt is not None and nxt.drawn is None:   # failed or drained: no results
                self._finish(nxt.step, [None] * len(nxt.step.chunks), t0, count=False)
                nxt = None
            if nxt is not None:
                self._between_steps()
            cur = nxt


def _pure_decode(step: Step) -> bool:
    # Rows with penalties or logprobs sample from an up-to-date history and read their
    # logprobs back every step: such a step runs synchronously.
    return all(c.samples and len(c.token_ids) == 1 and not c.seq.prefilling
               and not c.seq.params.synchronous for c in step.chunks)


def _discard(flight: InFlightStep) -> None:
    try:
        mx.eval(flight.drawn)
    except Exception:  # noqa: BLE001 - its results are dropped anyway
        pass
    mx.synchronize()
