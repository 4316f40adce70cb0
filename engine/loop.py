"""The engine: one dedicated thread owns the model and every MLX call (MLX streams are
thread-local); callers talk to it through a command queue and stream results back through
per-request asyncio sinks.

One iteration of the thread: take commands (submit/cancel/stop) -> admit (restoring checkpoints)
and schedule a step -> run it -> RETIRE it (evaluate the sampled tokens and the KV store arrays,
then synchronize) -> apply its result here (the runner only reports it) and emit deltas ->
RECLAIM pages and bytes of finished requests whose last step has retired.
Refunds therefore never precede the retirement of the work that used the memory; `trace`
(optional) observes the order for tests: ("retire", step), ("refund", request, last_step),
("permit", step, nbytes, granted), ("release", step, nbytes, active_before, active_after),
("arrival", request, ...), ("admit", request, ...), ("launch", step, ahead, requests) for each
pipelined decode step queued (ahead=1: built before the previous step was read back), ("step",
step, prefill_tokens, prefill_rows, decode_rows, seconds, model_calls, traces) per recorded step.

Workspace permits (fused prefill): a packed layer asks for bytes while the step's graph is built
(`WorkspacePermits.permit`); they are charged to that step in the ledger and returned only right
after the step retired (never when a request is cancelled: the cancel is applied between steps, and
the permit belongs to the step, not to the request). Commands, arrivals included, are applied only
between steps, so a request arriving while a fused step holds workspace is looked at after that
step retired and its permit was returned; its first-token deadline stays the original absolute one,
so the retirement time counts against it (and it may expire meanwhile).

A failure inside a step fails only the requests that caused it (the step is retried row by row
to find them); the thread itself never dies on a request.

This file holds the public API, the thread's main loop (which owns the decode pipeline's
in-flight queue and alone applies step results) and the commands it applies between steps. Its
parts, built by `engine.build.build` on the engine thread: the scheduler (engine/sched/),
`StepRunner` and `WorkspacePermits` (engine/steps.py), `ResultStreams` (engine/streams.py),
`RequestCheckpoints` (engine/checkpoint/requests.py), `EngineStats` (engine/stats.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import random
import threading
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

import numpy as np

from capacity.pricing import CostModel
from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.bridge import Sink
from engine.build import EngineParts, build
from engine.checkpoint.requests import CheckpointError, save_command
from engine.config import EngineConfig
from engine.errors import (DeadlineUnmeetable, EngineError, EngineOverloaded, EngineShutdown,
                           InvalidRequest, RequestTooLarge)
from engine.request import Delta, GenerationRequest, Usage, merge_deltas
from engine.sampling.params import SamplingParams
from engine.sched.seq import Seq, Step
from engine.stats import EngineStats, collect_stats
from engine.steps import StepResult

__all__ = ["Engine", "GenerationRequest", "SamplingParams", "Delta", "Usage"]

_IDLE_POLL_S = 0.005   # wait for commands while requests exist but no step can run


class Engine:
    # Pipeline steady decode steps (every KV format, no recurrent layers); tests may switch it off.
    pipeline_decode = True

    def __init__(self, cfg: EngineConfig, trace: Callable[..., None] | None = None,
                 logits_tap: Callable[[str, int, np.ndarray], None] | None = None,
                 kernels: KernelChoices = DEFAULT_KERNELS):
        """`kernels`: the attention kernels and compiled steps the runner may use (benches
        compare choices; production keeps the defaults). `logits_tap` (optional, for tests and
        quality checks) is called on the engine thread, once a step retired, with (request_id,
        token_index, logits) for every row that sampled a token: `logits` is a float32 numpy
        copy of exactly what the sampler read for the request's token number `token_index`
        (0 = first generated)."""
        self.cfg = cfg
        self._trace = trace
        self._logits_tap = logits_tap
        self._kernels = kernels
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._drain_deadline = float("inf")
        self._seq_ids = 0
        self._parts: EngineParts | None = None
        self._stats: EngineStats | None = None
        self._thread = threading.Thread(target=self._main, name="orchard-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    # ---- public API (any thread) -----------------------------------------------------------

    # What the engine runs (set before the constructor returns; read-only for callers).
    kv_format = property(lambda self: self._parts.kv_format)
    loaded = property(lambda self: self._parts.loaded)
    kvstore = property(lambda self: self._parts.kvstore)
    runner = property(lambda self: self._parts.runner)
    scheduler = property(lambda self: self._parts.scheduler)
    format_identity = property(lambda self: self._parts.format_identity)
    storage_identity = property(lambda self: self._parts.storage_identity)
    tokenizer = property(lambda self: self._parts.loaded.tokenizer)
    vocab_size = property(lambda self: self._parts.loaded.geometry.vocab_size)
    model_id = property(lambda self: self.cfg.model)

    def cost_model(self) -> CostModel:
        return self._parts.cost_model

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
        if p.min_tokens and not p.eos_token_ids:
            # The sampler holds back exactly the ids the scheduler would finish on.
            p = replace(p, eos_token_ids=tuple(sorted(self.scheduler.eos_ids)))
        # The grammar is compiled here, off the engine thread (a bad schema is refused now).
        constraint = None if p.grammar is None else \
            await asyncio.to_thread(self._parts.grammar.make, p.grammar)
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
        return self.call(save_command(request_id, path), timeout_s)

    def call(self, fn: Callable[[EngineParts], Any], timeout_s: float = 60.0) -> Any:
        """fn(parts) on the engine thread between steps; blocks for its result or error."""
        if not self.healthy():
            raise EngineShutdown("engine is not running")
        self._inbox.put(("call", fn, done := concurrent.futures.Future()))
        return done.result(timeout=timeout_s)

    def evict_prefix_cache(self) -> None:
        """Evict every cached prefix page no running request shares."""
        self.call(lambda p: p.scheduler.evict_cache(p.scheduler.pool.num_pages))

    def prefix_page_hashes(self) -> list[bytes]:
        """Chain hashes of every page the prefix cache holds (for prefix-aware routing); a
        copy of the engine thread's dict taken in one C call, so any thread may ask."""
        cache = self._parts.scheduler.prefix if self._parts is not None else None
        return [] if cache is None else list(cache._entries)

    def stats(self) -> EngineStats:
        """The snapshot published after the last step (attributes; `as_dict()` for JSON)."""
        return replace(self._stats, engine_alive=self.healthy())

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
            # active exception"; docs/lab/engine-notes.md). A parked daemon thread never tears down.
            threading.Event().wait()

    def _serve(self) -> None:
        try:
            self._parts = build(self.cfg, trace=self._trace, logits_tap=self._logits_tap,
                                pipeline_decode=self.pipeline_decode, kernels=self._kernels)
            self._publish_stats()
        except BaseException as e:  # noqa: BLE001 - reported to the constructor's caller
            self._startup_error = e if isinstance(e, Exception) else EngineError(repr(e))
            self._ready.set()
            return
        self._ready.set()
        sch = self._parts.scheduler
        while True:
            self._take_commands(block=sch.idle and not self._stopping.is_set())
            if self._stopping.is_set():
                if sch.idle:
                    break
                if time.monotonic() >= self._drain_deadline:
                    for s in [*sch.waiting, *sch.running]:
                        sch.cancel(s.request_id)
            self._reclaim()   # cancels just applied free their seats before admission
            for seq in sch.admit(time.monotonic()):
                self._admitted(seq)
            step = sch.next_step()
            if step is not None:
                self._run(step)
            elif not sch.idle:
                self._take_commands(block=True, timeout=_IDLE_POLL_S)
            self._between_steps()
        sch.evict_cache(sch.pool.num_pages)
        self._fail_inbox(EngineShutdown("engine shut down"))
        self._publish_stats()

    # ---- steps: run by the StepRunner, applied here -----------------------------------------

    def _run(self, step: Step) -> None:
        """Run one scheduled step: synchronously, or as the head of a decode pipeline."""
        steps = self._parts.steps
        if steps.pipelines(step):
            self._pipeline(step)
        else:
            self._record(steps.run(step))

    def _pipeline(self, step: Step) -> None:
        """Steady decode, one step queued ahead (engine/steps.py) while nothing waits and no
        command is pending; each step is recorded and followed by the loop's between-steps work."""
        steps, sch = self._parts.steps, self._parts.scheduler
        cur = steps.launch(step, ahead=0)
        while cur is not None:
            nxt = None
            if cur.launched and self._quiet() and sch.can_continue_decode(cur.step):
                nxt = steps.launch(sch.continue_decode(cur.step, cur.drawn), ahead=1)
            self._record(steps.collect(cur, queued=nxt))
            if nxt is not None and not nxt.launched:   # failed to build, or drained
                self._record(steps.drop(nxt))
                nxt = None
            elif nxt is not None:
                nxt.started = time.perf_counter()   # its time runs from the last step's end
                self._between_steps()
            cur = nxt

    def _record(self, result: StepResult) -> None:
        """Apply a retired step: failed rows, the rate forecast, counters, the scheduler's
        bookkeeping, and each new token to its stream."""
        p = self._parts
        for seq, error in result.failed:
            p.streams.fail(seq, error)
        if not result.recorded:
            return
        step = result.step
        p.scheduler.forecast.observe(step.prefill_tokens, step.decode_rows, result.seconds)
        # Model calls and traces so far (totals): per-step work shows in their differences.
        self._emit("step", step=step.step_id, prefill_tokens=step.prefill_tokens,
                   prefill_rows=step.prefill_rows, decode_rows=step.decode_rows,
                   seconds=result.seconds, model_calls=result.model_calls, traces=result.traces)
        p.counters["steps"] += 1
        p.counters["prompt_tokens"] += step.prefill_tokens
        for seq, tok in p.scheduler.complete(step, result.tokens, time.monotonic()):
            p.counters["generation_tokens"] += 1
            p.streams.deliver(seq, tok, result.logprobs.get(seq.request_id))

    def _between_steps(self) -> None:
        """After a step (or an idle turn): final deltas of requests finished without a token,
        reclaim, the stats snapshot, then the deltas go out (see engine/streams.py)."""
        streams = self._parts.streams
        streams.close_finished()
        self._reclaim()
        self._publish_stats()
        streams.flush()

    def _quiet(self) -> bool:
        return self._inbox.empty() and not self._stopping.is_set()

    def _reclaim(self) -> None:
        p = self._parts
        for seq in p.scheduler.reclaim(p.steps.retired_step):
            p.runner.release(seq.seq_id)
            self._emit("refund", request=seq.request_id, last_step=seq.last_step)

    def _emit(self, event: str, **fields) -> None:
        if self._trace is not None:
            self._trace(event, **fields)

    def _publish_stats(self) -> None:
        p, cfg = self._parts, self.cfg
        self._stats = collect_stats(
            model_id=cfg.model, format_identity=p.format_identity, kv_format=p.kv_format,
            prefill_mode=cfg.prefill_mode, storage_identity=p.storage_identity,
            layer_report=p.layer_report, tenant=cfg.tenant, kvstore=p.kvstore,
            scheduler=p.scheduler, retired_step=p.steps.retired_step, counters=p.counters)

    # ---- commands: applied on the engine thread, between steps ----------------------------

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
        p = self._parts
        if cmd[0] == "submit":
            _, seq, sink = cmd
            try:
                if self._stopping.is_set():
                    raise EngineShutdown("engine is shutting down")
                if seq.request_id in p.streams.live:
                    raise InvalidRequest(f"request id {seq.request_id!r} is already running")
                now = time.monotonic()
                ledger = p.scheduler.ledger
                self._emit("arrival", request=seq.request_id, now=now, deadline=seq.deadline,
                           retired_step=p.steps.retired_step,
                           workspace_bytes=ledger.workspace_bytes,
                           free_bytes=ledger.cost_model.free_bytes(ledger.used_bytes))
                if seq.restore is not None:
                    p.checkpoints.check_restorable(seq)
                p.scheduler.submit(seq, now)
            except EngineError as e:
                if not isinstance(e, (RequestTooLarge, EngineOverloaded, DeadlineUnmeetable)):
                    p.counters[f"refused_{e.reason}"] += 1   # the scheduler counts its own
                sink.put(e, final=True)
                return
            self._seq_ids += 1
            seq.seq_id = self._seq_ids
            p.streams.open(seq, sink)
        elif cmd[0] == "cancel":
            p.scheduler.cancel(cmd[1])
        elif cmd[0] == "call":
            try:
                cmd[2].set_result(cmd[1](p))
            except Exception as e:  # noqa: BLE001 - reported to the caller, never kills the thread
                cmd[2].set_exception(e if isinstance(e, EngineError) else CheckpointError(repr(e)))

    def _admitted(self, seq: Seq) -> None:
        """Just admitted: trace it, and restore its checkpoint before its first step is built."""
        p = self._parts
        self._emit("admit", request=seq.request_id, cached_tokens=seq.cached_tokens,
                   charged=p.scheduler.ledger.held(seq.request_id),
                   retired_step=p.steps.retired_step)
        if seq.restore is not None:
            error = p.checkpoints.restore_admitted(seq)
            if error is not None:
                p.streams.refuse(seq, error)

    def _fail_inbox(self, exc: EngineError) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit":
                cmd[2].put(exc, final=True)
            elif cmd[0] == "call":
                cmd[2].set_exception(exc)
