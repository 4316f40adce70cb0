"""The engine: one dedicated thread owns the model and every MLX call (MLX streams are
thread-local); callers talk to it through a command queue and stream results back through
per-request asyncio sinks.

One iteration of the thread: take commands (submit/cancel/stop) -> schedule a step -> run it ->
RETIRE it (evaluate the sampled tokens and the KV store arrays, then synchronize) -> record tokens
and emit deltas -> RECLAIM pages and bytes of finished requests whose last step has retired.
Refunds therefore never precede the retirement of the work that used the memory; `trace`
(optional) observes the order for tests: ("retire", step), ("refund", request, last_step),
("permit", step, nbytes, granted), ("release", step, nbytes, active_before, active_after),
("arrival", request, ...), ("admit", request, ...).

Workspace permits (fused prefill): a packed layer asks `_permit(nbytes)` while the step's graph
is built; the bytes are charged to that step in the ledger and returned only right after the
step retired (never when a request is cancelled: the cancel is applied between steps, and the
permit belongs to the step, not to the request). Commands, arrivals included, are applied only
between steps, so a request arriving while a fused step holds workspace is looked at after that
step retired and its permit was returned; its first-token deadline stays the original absolute
one, so the retirement time counts against it (and it may expire meanwhile).

A failure inside a step fails only the requests that caused it (the step is retried row by row
to find them); the thread itself never dies on a request.

This file holds the public API and the thread's main loop; each part of the thread's work is a
mixin in its own file, all sharing the Engine's state (set up by `_start`):
  engine/build.py          load the model, size the KV budget, build store/scheduler
  engine/loop.py         apply callers' commands between steps; admission hook
  engine/steps.py            run, retire and release one synchronous step
  engine/steps.py         queue steady decode steps ahead of their read-back
  engine/streams.py          deltas back to callers, after each step's bookkeeping
  engine/checkpoint/requests.py restore at admission, save on command or at finish
  engine/stats.py            the stats() snapshot
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import random
import threading
import time
from typing import AsyncIterator, Callable

import numpy as np

from capacity.pricing import CostModel
from engine.bridge import Sink
from engine.config import EngineConfig
from engine.decode_pipeline import DecodePipeline
from engine.engine_checkpoint_hooks import CheckpointHooks
from engine.engine_commands import CommandInbox
from engine.build import EngineStartup
from engine.stats import collect_stats
from engine.steps import StepExecution
from engine.streams import ResultStreams
from engine.errors import EngineError, EngineShutdown, InvalidRequest
from engine.request import Delta, GenerationRequest, Usage, merge_deltas
from engine.sampling.params import SamplingParams
from engine.sched.seq import Seq

__all__ = ["Engine", "GenerationRequest", "SamplingParams", "Delta", "Usage"]

_IDLE_POLL_S = 0.005   # wait for commands while requests exist but no step can run


class Engine(EngineStartup, CommandInbox, StepExecution, DecodePipeline, ResultStreams,
             CheckpointHooks):
    # Pipeline steady decode steps (native KV, no recurrent layers); tests may switch it off.
    pipeline_decode = True

    def __init__(self, cfg: EngineConfig, trace: Callable[..., None] | None = None,
                 logits_tap: Callable[[str, int, np.ndarray], None] | None = None):
        """`logits_tap` (optional, for tests and quality checks) is called on the engine thread,
        once a step retired, with (request_id, token_index, logits) for every row that sampled
        a token: `logits` is a float32 numpy copy of exactly what the sampler read for the
        request's token number `token_index` (0 = first generated)."""
        self.cfg = cfg
        self._trace = trace
        self._logits_tap = logits_tap
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._drain_deadline = float("inf")
        self._stats: dict = {}
        self._thread = threading.Thread(target=self._main, name="orchard-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    # ---- public API (any thread) -----------------------------------------------------------

    def cost_model(self) -> CostModel:
        return self._cost_model

    async def generate(self, req: GenerationRequest, coalesce: bool = False
                       ) -> AsyncIterator[Delta]:
        """Stream deltas of one request. Refusals raise before the first delta.

        `coalesce`: when the consumer fell behind (several deltas already queued), hand them
        over as one merged delta: a slow consumer then costs fewer messages downstream (one
        per read instead of one per token) and never falls further behind."""
        if not self.healthy():
            raise EngineShutdown("engine is not running")
        bad = [t for t in req.prompt_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range (vocab {self.vocab_size}): "
                                 f"{bad[:5]}")
        p = req.params
        bad = [t for t in p.token_ids_used() if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias / stop_token_ids name token ids out of range "
                                 f"(vocab {self.vocab_size}): {bad[:5]}")
        # The grammar is compiled here, off the engine thread (a bad schema is refused now).
        constraint = None if p.grammar is None else \
            await asyncio.to_thread(self._grammar_constraints.make, p.grammar)
        seq = Seq(req.request_id, req.prompt_ids, p,
                  seed=p.seed if p.seed is not None else random.getrandbits(63),
                  deadline=req.first_token_deadline, arrival=time.monotonic(),
                  tenant=req.tenant or self.cfg.tenant, restore=req.restore_from,
                  checkpoint_to=req.checkpoint_to, constraint=constraint)
        sink = Sink(asyncio.get_running_loop())
        self._inbox.put(("submit", seq, sink))
        done = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                while coalesce and item.finish_reason is None and not sink.queue.empty():
                    nxt = sink.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        sink.queue.put_nowait(nxt)   # raised on the next read, after this item
                        break
                    item = merge_deltas(item, nxt)
                if item.finish_reason is not None:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:   # consumer went away (closed the iterator, task cancelled)
                self.cancel(req.request_id)

    def cancel(self, request_id: str) -> None:
        """Cancel a request wherever it is; unknown or finished ids are ignored (idempotent)."""
        self._inbox.put(("cancel", request_id))

    def save_checkpoint(self, request_id: str, path: str, timeout_s: float = 60.0) -> dict:
        """Save the KV rows a running request has computed so far (between steps, so the step
        that wrote them retired) and return the manifest; `num_tokens` says how many of its
        tokens (prompt, then generated) the checkpoint covers. Blocks until written."""
        if not self.healthy():
            raise EngineShutdown("engine is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("save", request_id, str(path), done))
        return done.result(timeout=timeout_s)

    def evict_prefix_cache(self) -> None:
        """Evict every cached prefix page no running request shares (asynchronous)."""
        self._inbox.put(("evict",))

    def stats(self) -> dict:
        return dict(self._stats, engine_alive=self.healthy())

    def healthy(self) -> bool:
        return self._thread.is_alive() and not (self._stopping.is_set() or self._stopped.is_set())

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let running requests finish for up to drain_timeout_s, cancel the
        rest, release everything, and stop the thread."""
        if not self._stopped.is_set():
            self._drain_deadline = time.monotonic() + drain_timeout_s
            self._stopping.set()
            self._inbox.put(("wake",))
            self._stopped.wait()

    # ---- engine thread ---------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._serve()
        finally:
            self._stopped.set()
            # Park instead of exiting: a thread that ran compiled MLX code and then exits races
            # MLX's thread-local teardown against interpreter exit ("terminate called without an
            # active exception", measured ~50% of runs). A parked daemon thread never tears down.
            threading.Event().wait()

    def _serve(self) -> None:
        try:
            self._start()
        except BaseException as e:  # noqa: BLE001 - reported to the constructor's caller
            self._startup_error = e if isinstance(e, Exception) else EngineError(repr(e))
            self._ready.set()
            return
        self._ready.set()
        while True:
            self._take_commands(block=self.scheduler.idle and not self._stopping.is_set())
            if self._stopping.is_set():
                if self.scheduler.idle:
                    break
                if time.monotonic() >= self._drain_deadline:
                    for s in [*self.scheduler.waiting, *self.scheduler.running]:
                        self.scheduler.cancel(s.request_id)
            self._reclaim()   # cancels just applied free their seats before admission
            step = self.scheduler.schedule(time.monotonic())
            if step is not None:
                self._run_step(step)
            elif not self.scheduler.idle:
                self._take_commands(block=True, timeout=_IDLE_POLL_S)
            self._close_finished()
            self._reclaim()
            self._publish_stats()
            self._flush_outbox()
        self.scheduler.evict_cache(self.scheduler.pool.num_pages)
        self._fail_inbox(EngineShutdown("engine shut down"))
        self._publish_stats()

    def _reclaim(self) -> None:
        for seq in self.scheduler.reclaim(self._retired_step):
            self.runner.release(seq.seq_id)
            self._emit("refund", request=seq.request_id, last_step=seq.last_step)

    def _emit(self, event: str, **fields) -> None:
        if self._trace is not None:
            self._trace(event, **fields)

    def _publish_stats(self) -> None:
        self._stats = collect_stats(self)
