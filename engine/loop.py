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
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections import Counter
from typing import AsyncIterator, Callable

import mlx.core as mx
import numpy as np

from capacity.formats import KVFormat, resolve_kv_format
from capacity.pricing import CostModel
from engine.bridge import Sink
from engine.budget import ByteLedger, build_cost_model, resolve_budget_bytes
from engine.checkpoint import CheckpointError
from engine.config import EngineConfig
from engine.detok import TextStream
from engine.engine_stats import collect_stats
from engine.errors import (DeadlineUnmeetable, EngineError, EngineOverloaded, EngineShutdown,
                           InvalidRequest, RequestTooLarge)
from engine.pages import PagePool, pages_for
from engine.prefix import PrefixCache, chain_root
from engine.request import Delta, GenerationRequest, Usage
from engine.request_checkpoints import RequestCheckpoints
from engine.runner import SeqChunk, check_supported_layers
from engine.sampling import RowSpec, SamplingParams, sample
from engine.scheduler import FINISHED, RUNNING, RateForecast, Scheduler, Seq, Step

__all__ = ["Engine", "GenerationRequest", "SamplingParams", "Delta", "Usage"]

log = logging.getLogger("orchard.engine")
_IDLE_POLL_S = 0.005   # wait for commands while requests exist but no step can run


class _Live:
    """Engine-thread state of one streaming request."""

    def __init__(self, seq: Seq, sink: Sink, text: TextStream):
        self.seq, self.sink, self.text = seq, sink, text
        self.sent_first = False


class _InFlight:
    """A queued (pipelined) decode step and its lazy results."""

    __slots__ = ("step", "logits", "drawn")

    def __init__(self, step: Step, logits, drawn):
        self.step, self.logits, self.drawn = step, logits, drawn


class Engine:
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

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream deltas of one request. Refusals raise before the first delta."""
        if not self.healthy():
            raise EngineShutdown("engine is not running")
        bad = [t for t in req.prompt_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range (vocab {self.vocab_size}): "
                                 f"{bad[:5]}")
        p = req.params
        seq = Seq(req.request_id, req.prompt_ids, p,
                  seed=p.seed if p.seed is not None else random.getrandbits(63),
                  deadline=req.first_token_deadline, arrival=time.monotonic(),
                  tenant=req.tenant or self.cfg.tenant, restore=req.restore_from,
                  checkpoint_to=req.checkpoint_to)
        sink = Sink(asyncio.get_running_loop())
        self._inbox.put(("submit", seq, sink))
        done = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
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

    def _start(self) -> None:
        from engine.kvstore import KVStore
        from engine.model import load_model
        from engine.packed_store import layer_report, storage_identity

        cfg = self.cfg
        # Policy before any weights are read: an unknown value refuses the load (no fallback).
        self.kv_format = resolve_kv_format(cfg.model, cfg.kv_format, cfg.kv_format_overrides)
        loaded = load_model(cfg.model, dtype=cfg.dtype, allow_hub=cfg.allow_hub)
        check_supported_layers(loaded)   # before any KV memory is sized or allocated
        self._step_id: int | None = None     # the step whose graph is being built
        self._step_arrays: list = []         # its device results, dropped when it is released
        factory, runner_cls = _store_for(self.kv_format, cfg.prefill_mode, self._permit)
        probe = KVStore(loaded.geometry, 1, cfg.page_tokens, loaded.dtype, layer_factory=factory)
        page_bytes = probe.page_bytes
        del probe
        if page_bytes <= 0:
            raise EngineError(f"{cfg.model}: no layer keeps paged KV; nothing to budget")
        token_limit = cfg.max_model_len or int(loaded.config.get("max_position_embeddings")
                                               or 8192)
        budget = resolve_budget_bytes(
            cfg.kv_budget_bytes, cfg.kv_memory_fraction, page_bytes,
            max_useful_bytes=cfg.max_num_seqs * pages_for(token_limit, cfg.page_tokens)
            * page_bytes)
        num_pages = budget // page_bytes
        self.kvstore = KVStore(loaded.geometry, num_pages, cfg.page_tokens, loaded.dtype,
                               layer_factory=factory)
        self.runner = runner_cls(loaded, self.kvstore)
        self._cost_model = build_cost_model(
            budget_bytes=num_pages * page_bytes, bytes_per_token=self.kvstore.bytes_per_token,
            page_tokens=cfg.page_tokens,
            fixed_bytes_per_request=loaded.geometry.state_bytes_per_sequence,
            max_num_seqs=cfg.max_num_seqs, token_limit=token_limit)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.geometry.vocab_size
        self.model_id = cfg.model
        head_dim = next((g.head_dim for g in loaded.geometry.layers if g.paged), 0)
        self.format_identity = KVFormat(self.kv_format, head_dim, loaded.dtype_name).identity
        self.storage_identity = storage_identity(self.kvstore)
        self._layer_report = layer_report(self.kvstore)
        eos = set(getattr(loaded.tokenizer, "eos_token_ids", None) or ())
        pool = PagePool(num_pages, cfg.page_tokens)
        prefix = root_of = None
        if cfg.enable_prefix_caching:
            if loaded.geometry.unpaged_layers:
                raise EngineError(f"{cfg.model}: prefix caching needs every layer's state in "
                                  "pages; its recurrent layers summarize whole prompts")
            prefix = PrefixCache(pool)
            roots: dict[str, bytes] = {}

            def root_of(seq: Seq) -> bytes:
                if seq.tenant not in roots:
                    roots[seq.tenant] = chain_root(self.storage_identity, loaded.fingerprint,
                                                   seq.tenant, cfg.page_tokens)
                return roots[seq.tenant]
        self.scheduler = Scheduler(
            pool, ByteLedger(self._cost_model),
            max_num_seqs=cfg.max_num_seqs, max_step_tokens=cfg.max_step_tokens,
            max_waiting=cfg.max_waiting, eos_ids=eos,
            forecast=RateForecast(cfg.rate_ewma_alpha), prefix=prefix, root_of=root_of,
            on_admit=self._on_admit)
        self._checkpoints = RequestCheckpoints(
            self.model_id, self.kvstore, loaded.fingerprint,
            cfg.checkpoint_key.encode() if cfg.checkpoint_key else None, cfg.page_tokens,
            has_recurrent_state=self.runner.recurrent is not None)
        self._live: dict[str, _Live] = {}
        self._outbox: list[tuple[Sink, Delta]] = []
        self._seq_ids = 0
        self._retired_step = -1
        self._counters: Counter[str] = Counter()
        # Pipelined decode needs steps that never ask for workspace (packed formats' fused
        # paths do) and no per-sequence state outside the pages (recurrent layers).
        self._pipeline = (self.pipeline_decode and self.kv_format == "native"
                          and self.runner.recurrent is None)
        self._publish_stats()

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
            self._live[seq.request_id] = _Live(
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

    def _run_step(self, step: Step) -> None:
        if self._pipeline and self._pure_decode(step):
            self._run_pipelined(step)
            return
        t0 = time.perf_counter()
        self._step_id = step.step_id
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

    # ---- pipelined decode ------------------------------------------------------------------
    # Steady decode (every running request decoding one token, nothing waiting, no command
    # pending) queues step n+1 with step n's still-lazy sampled tokens before reading step n
    # back, as mlx-lm's generators do, so building a step's graph overlaps the previous step's
    # compute. Invariants kept:
    # - retire-then-refund: step n+1 sets `last_step` of every row it holds, so a request that
    #   finishes when step n completes (EOS, stop string, cancel by a gone consumer) keeps its
    #   pages until step n+1 retired; its step n+1 token is discarded (`complete` skips rows
    #   that are no longer running) and was written to its own, still-held pages.
    # - max_tokens: step n+1 is built only when every row has >= 2 tokens left, so no row's
    #   extra step is ever past its reservation and a length finish never wastes a step.
    # - determinism: a row's sampling key is (seed, token index) as in a synchronous step.
    # - commands (submit, cancel, save, evict, shutdown) are applied only between steps: a
    #   pending one stops the pipeline, the in-flight step retires, and the main loop runs.
    # - failures: a step that fails to build or to evaluate drains the pipeline; the failed
    #   step is retried row by row as usual and the queued one is retired without results.

    def _pure_decode(self, step: Step) -> bool:
        return all(c.samples and len(c.token_ids) == 1 and not c.seq.prefilling
                   for c in step.chunks)

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

    def _launch(self, step: Step, ahead: int) -> _InFlight:
        """Build a decode step's graph and queue it (mx.async_eval); `ahead` = 1 when the
        previous step's tokens are not yet in `output_ids` (they are this step's inputs)."""
        self._step_id = step.step_id
        try:
            chunks = step.chunks
            logits = self.runner.forward([SeqChunk(c.seq.seq_id, c.token_ids, c.start,
                                                   c.seq.table.pages) for c in chunks])
            drawn = sample(logits, [RowSpec(c.seq.params, c.seq.seed,
                                            len(c.seq.output_ids) + ahead) for c in chunks])
            mx.async_eval(drawn, self.kvstore.arrays())
        finally:
            self._step_id = None
        return _InFlight(step, logits, drawn)

    def _run_pipelined(self, step: Step) -> None:
        t0 = time.perf_counter()
        mx.reset_peak_memory()
        try:
            cur = self._launch(step, 0)
        except Exception:  # noqa: BLE001 - the synchronous path isolates the failing rows
            cur = _InFlight(step, None, None)
        while cur is not None:
            nxt = None
            if cur.drawn is not None and self._may_continue(cur.step):
                ahead = self.scheduler.continue_decode(cur.step, cur.drawn)
                try:
                    nxt = self._launch(ahead, 1)
                except Exception:  # noqa: BLE001 - retired below without results
                    log.exception("pipelined step %d failed to build", ahead.step_id)
                    nxt = _InFlight(ahead, None, None)
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
                    nxt = _InFlight(nxt.step, None, None)
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

    def _discard(self, flight: _InFlight) -> None:
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

    def _forward_and_sample(self, chunks) -> list[int | None]:
        """Run one forward, sample the rows that need a token, and RETIRE the step."""
        logits = self.runner.forward([SeqChunk(c.seq.seq_id, c.token_ids, c.start,
                                               c.seq.table.pages) for c in chunks])
        rows = [i for i, c in enumerate(chunks) if c.samples]
        drawn = None
        if rows:
            specs = [RowSpec(chunks[i].seq.params, chunks[i].seq.seed,
                             len(chunks[i].seq.output_ids)) for i in rows]
            picked = logits if len(rows) == len(chunks) else logits[mx.array(rows)]
            drawn = sample(picked, specs)
        # Retirement: the tokens and every KV page array are computed and the device is idle.
        mx.eval(drawn if drawn is not None else logits, self.kvstore.arrays())
        mx.synchronize()
        self._step_arrays.extend((logits, drawn))
        if rows:
            self._tap([chunks[i] for i in rows], picked)
        out: list[int | None] = [None] * len(chunks)
        for i, t in zip(rows, drawn.tolist() if drawn is not None else []):
            out[i] = t
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

    def _on_admit(self, seq: Seq) -> None:
        self._emit("admit", request=seq.request_id, cached_tokens=seq.cached_tokens,
                   charged=self.scheduler.ledger.held(seq.request_id),
                   retired_step=self._retired_step)
        if seq.restore is not None:
            self._restore(seq)

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

    def _fail(self, seq: Seq, exc: Exception) -> None:
        self.scheduler.finish(seq, "error")
        live = self._live.pop(seq.request_id, None)
        if live is not None:
            live.sink.put(EngineError(f"request failed inside the engine: {exc!r}"), final=True)

    def _deliver(self, seq: Seq, tok: int) -> None:
        live = self._live.get(seq.request_id)
        if live is None:
            return
        try:
            if seq.status == FINISHED and seq.finish_reason == "stop":
                text = live.text.flush()   # EOS: never decoded, but held-back text is released
            else:
                text = live.text.push(tok)
                if live.text.stopped:
                    self.scheduler.finish(seq, "stop")
                elif seq.status == FINISHED:
                    text += live.text.flush()
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode an id
            self._fail(seq, e)
            return
        self._send(live, text, [tok], seq.finish_reason if seq.status == FINISHED else None)

    def _send(self, live: _Live, text: str, token_ids: list[int], reason: str | None) -> None:
        seq = live.seq
        ttft = None
        if not live.sent_first and seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival
            live.sent_first = True
        ckpt = None
        if reason is not None and seq.checkpoint_to is not None:
            ckpt = self._save_finished(seq)
        delta = Delta(seq.request_id, text, token_ids, reason,
                      Usage(len(seq.prompt_ids), len(seq.output_ids), seq.cached_tokens), ttft,
                      ckpt)
        self._outbox.append((live.sink, delta))
        if reason is not None:
            self._live.pop(seq.request_id, None)

    def _flush_outbox(self) -> None:
        """Hand this iteration's deltas over after reclaim and stats, so a caller that sees a
        final delta also sees its request's pages and bytes back in stats()."""
        out, self._outbox = self._outbox, []
        for sink, delta in out:
            final = delta.finish_reason is not None
            if not sink.put(delta, final=final) and not final:
                self.scheduler.cancel(delta.request_id)   # nobody is listening any more

    def _close_finished(self) -> None:
        """Final deltas for requests finished without a token (cancel, deadline, drain)."""
        for seq in self.scheduler.pop_finished():
            live = self._live.get(seq.request_id)
            if live is not None:
                self._send(live, "", [], seq.finish_reason)

    def _reclaim(self) -> None:
        for seq in self.scheduler.reclaim(self._retired_step):
            self.runner.release(seq.seq_id)
            self._emit("refund", request=seq.request_id, last_step=seq.last_step)

    def _emit(self, event: str, **fields) -> None:
        if self._trace is not None:
            self._trace(event, **fields)

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

    def _publish_stats(self) -> None:
        self._stats = collect_stats(self)


def _store_for(kv_format: str, prefill_mode: str, permit: Callable[[int], bool]):
    """KV layer-store factory and runner class for a format (packed formats hook attention)."""
    from engine.kvstore import NativeLayerStore
    from engine.runner import ModelRunner

    if kv_format == "native":
        return NativeLayerStore, ModelRunner
    from engine.packed_cache import PackedModelRunner
    from engine.packed_store import packed_layer_factory

    return packed_layer_factory(kv_format, prefill_mode, permit), PackedModelRunner
