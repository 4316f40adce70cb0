"""The step runner: build a step's graph, sample, RETIRE it, release it, report its tokens.

Retirement means the sampled tokens and every KV page array are evaluated and the device is idle;
only then are the step's device results dropped and its workspace permits (fused prefill)
returned, so the ledger never refunds bytes the device may still be using. A step that fails is
retried row by row so only the requests that caused the failure fail.

The runner returns what a step produced (`StepResult`) and never updates the scheduler, the
streams or the counters: the loop (engine/loop.py) alone applies results, and it owns the queue of
in-flight steps. Two ways to run a step, one way to end it (`_retire`):
- synchronous (`run`): build, evaluate, synchronize, retire;
- pipelined steady decode (`launch`, `collect`, `drop`): every running request decoding one
  token, nothing waiting, no command pending. Step n+1 is queued with step n's still-lazy
  sampled tokens before step n is read back, as mlx-lm's generators do, so building a step's
  graph overlaps the previous step's compute. Invariants kept:
  - retire-then-refund: step n+1 sets `last_step` of every row it holds, so a request that
    finishes when step n completes (EOS, stop string, cancel by a gone consumer) keeps its
    pages until step n+1 retired; its step n+1 token is discarded (`complete` skips rows
    that are no longer running) and was written to its own, still-held pages.
  - max_tokens: step n+1 is built only when every row has >= 2 tokens left, so no row's
    extra step is ever past its reservation and a length finish never wastes a step
    (`Scheduler.can_continue_decode`).
  - determinism: a row's sampling key is (seed, token index) as in a synchronous step.
  - commands (submit, cancel, save, evict, shutdown) are applied only between steps: a
    pending one stops the pipeline, the in-flight step retires, and the main loop runs.
  - failures: a step that fails to build or to evaluate drains the pipeline; the failed
    step is retried row by row as usual and the queued one is retired without results.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from engine.sampling.sampler import StepLogprobs, row_spec, sample
from engine.sched.seq import Step

log = logging.getLogger("orchard.engine")

Emit = Callable[..., None]   # the engine's trace: emit(event, **fields)


def no_trace(event: str, **fields) -> None:
    """The trace of an engine nobody observes."""


class WorkspacePermits:
    """Workspace for the step whose graph is being built (fused prefill), from the byte ledger.

    A packed layer asks `permit(nbytes)` while the step's graph is built; the bytes are charged
    to that step and returned by `release` right after the step retired (never when a request is
    cancelled: the permit belongs to the step, not to the request). `ledger`: the scheduler's
    ByteLedger (built before the stores that ask for permits).
    """

    def __init__(self, ledger, emit: Emit):
        self._emit = emit
        self.ledger = ledger
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
    """A queued (pipelined) decode step and its lazy results; `started`: its clock (the loop
    restarts it when the previous step was recorded)."""

    __slots__ = ("step", "logits", "drawn", "started")

    def __init__(self, step: Step, logits, drawn, started: float):
        self.step, self.logits, self.drawn, self.started = step, logits, drawn, started

    @property
    def launched(self) -> bool:
        """Its graph was built and queued (False: it failed to build, or was drained)."""
        return self.drawn is not None

    def drain(self) -> None:
        """Wait for its device work and drop its results (it will retire without results)."""
        try:
            mx.eval(self.drawn)
        except Exception:  # noqa: BLE001 - its results are dropped anyway
            pass
        mx.synchronize()
        self.logits = self.drawn = None


@dataclass
class StepResult:
    """What one retired step produced. The runner only reports it; the loop alone applies it
    to the scheduler, the result streams and the counters (as vLLM's core applies a
    ModelRunnerOutput)."""

    step: Step
    tokens: list[int | None]     # per row: its sampled token; None (no sample, or it failed)
    seconds: float               # from the step's start to its retirement
    model_calls: int             # the runner's totals at retirement (a step's work shows in
    traces: int                  # their differences: the "step" trace event)
    failed: list = field(default_factory=list)     # (Seq, Exception): rows that failed
    logprobs: dict = field(default_factory=dict)   # request id -> its token's logprobs
    recorded: bool = True        # False: a drained pipelined step, retired without results


class StepRunner:
    """Runs scheduled steps on the engine thread and retires them; `retired_step` is the last
    one retired. It never updates the scheduler or the streams: every step ends in a
    `StepResult` for the loop.

    Synchronous: `run(step)`. Pipelined steady decode (`pipelines(step)`), driven by the loop,
    which owns the queue of in-flight steps: `launch` queues a step, `collect` reads the oldest
    back and retires it, `drop` retires a queued step that has no results.
    `pipeline`: whether steady decode may be pipelined at all.
    """

    def __init__(self, *, runner, kvstore, permits: WorkspacePermits, emit: Emit, pipeline: bool,
                 logits_tap: Callable[[str, int, np.ndarray], None] | None = None):
        self.runner, self.kvstore, self.permits = runner, kvstore, permits
        self._emit, self.pipeline, self._logits_tap = emit, pipeline, logits_tap
        self.retired_step = -1
        # CPU steps draw sampled tokens with NumPy (engine/sampling/sampler.py `_draw_host`):
        # MLX's CPU Gumbel noise is scalar math over the whole vocabulary.
        self.host_draw = runner.in_place_decode and runner.kernels.cpu_sampling

    def pipelines(self, step: Step) -> bool:
        """Whether `step` runs pipelined (`launch`/`collect`) rather than through `run`."""
        return self.pipeline and _pure_decode(step)

    def run(self, step: Step) -> StepResult:
        """Build, evaluate, synchronize and retire one step (rows that fail are isolated)."""
        t0 = time.perf_counter()
        mx.reset_peak_memory()   # the release event reports this step's peak (workspace evidence)
        result = StepResult(step, [], 0.0, 0, 0)
        try:
            result.tokens = self._forward_and_sample(step.chunks, step.step_id, result)
        except Exception:  # noqa: BLE001 - isolate the rows that fail; never kill the thread
            result.tokens = self._isolate_failures(step, result)
        return self._retire(result, t0)

    # ---- retirement: the one end of every step ---------------------------------------------

    def _retire(self, result: StepResult, t0: float) -> StepResult:
        """The step's device work is done (its results were read): retire it, then release its
        device results and workspace permits."""
        step = result.step
        self.retired_step = step.step_id
        self._emit("retire", step=step.step_id)
        self.permits.release(step.step_id)
        result.seconds = time.perf_counter() - t0
        compiled = self.runner.compiled
        result.model_calls = self.runner.model_calls
        result.traces = compiled.traces if compiled is not None else 0
        return result

    # ---- synchronous steps -----------------------------------------------------------------

    def _forward_and_sample(self, chunks, step_id: int, result: StepResult) -> list[int | None]:
        """Run one forward, sample the rows that need a token, and evaluate everything the
        step wrote (retirement follows)."""
        self.permits.step_id = step_id
        try:
            logits = self.runner.forward(chunks)
            rows = [i for i, c in enumerate(chunks) if c.samples]
            drawn = None
            if rows:
                specs = [row_spec(chunks[i].seq, 0) for i in rows]
                picked = logits if len(rows) == len(chunks) else logits[mx.array(rows)]
                drawn = sample(picked, specs, self.host_draw)
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
                result.logprobs[chunks[rows[j]].seq.request_id] = lp
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

    def _isolate_failures(self, step: Step, result: StepResult) -> list[int | None]:
        out: list[int | None] = [None] * len(step.chunks)
        for i, c in enumerate(step.chunks):
            try:
                out[i] = self._forward_and_sample([c], step.step_id, result)[0]
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed in step %d", c.seq.request_id, step.step_id)
                result.failed.append((c.seq, e))
        mx.synchronize()
        return out

    # ---- pipelined steady decode (the loop owns the queue) ---------------------------------

    def launch(self, step: Step, ahead: int) -> InFlightStep:
        """Build a decode step's graph and queue it (mx.async_eval); `ahead` = 1 when the
        previous step's tokens are not yet in `output_ids` (they are this step's inputs).
        Never raises: a step that fails to build comes back not `launched`."""
        started = time.perf_counter()
        if ahead == 0:   # the head of a pipeline: the release event reports its peak
            mx.reset_peak_memory()
        self._emit("launch", step=step.step_id, ahead=ahead,
                   requests={c.seq.request_id for c in step.chunks})
        self.permits.step_id = step.step_id
        try:
            chunks = step.chunks
            logits = self.runner.forward(chunks, decode_tokens=step.inputs)
            drawn = sample(logits, [row_spec(c.seq, ahead) for c in chunks], self.host_draw)
            mx.async_eval(drawn, self.kvstore.arrays())
        except Exception:  # noqa: BLE001 - collect retries the head row by row; drop the rest
            if ahead:
                log.exception("pipelined step %d failed to build", step.step_id)
            return InFlightStep(step, None, None, started)
        finally:
            self.permits.step_id = None
        return InFlightStep(step, logits, drawn, started)

    def collect(self, flight: InFlightStep, queued: InFlightStep | None) -> StepResult:
        """Read back the oldest in-flight step and retire it; `queued`: the step launched after
        it (it stays queued). When this step failed, `queued` is drained and this step is
        retried row by row (the retry taps its own rows)."""
        result = StepResult(flight.step, [], 0.0, 0, 0)
        tokens = None
        if flight.launched:
            try:
                tokens = flight.drawn.tolist()   # waits for this step only; `queued` stays queued
            except Exception:  # noqa: BLE001
                tokens = None
        if tokens is not None:
            self._tap(flight.step.chunks, flight.logits)
        else:
            if queued is not None:
                queued.drain()
            tokens = self._isolate_failures(flight.step, result)
        if queued is None:
            # The last step of the run: the device goes idle, as in a synchronous step.
            try:
                mx.eval(self.kvstore.arrays())
            except Exception:  # noqa: BLE001 - never kill the thread; later steps fail rows
                log.exception("KV arrays failed to evaluate after step %d", flight.step.step_id)
            mx.synchronize()
        # Its device results are dropped inside the release, as a synchronous step's are.
        self.permits.arrays.extend(a for a in (flight.logits, flight.drawn) if a is not None)
        flight.logits = flight.drawn = None
        result.tokens = tokens
        return self._retire(result, flight.started)

    def drop(self, flight: InFlightStep) -> StepResult:
        """Retire a queued step that failed to build or was drained: no results to record."""
        return self._retire(StepResult(flight.step, [None] * len(flight.step.chunks), 0.0, 0, 0,
                                       recorded=False), flight.started)


def _pure_decode(step: Step) -> bool:
    # Rows with penalties or logprobs sample from an up-to-date history and read their
    # logprobs back every step: such a step runs synchronously.
    return all(c.samples and len(c.token_ids) == 1 and not c.seq.prefilling
               and not c.seq.params.synchronous for c in step.chunks)
