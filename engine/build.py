"""Engine assembly: `build(cfg)` makes the parts the engine thread owns.

Policy first (the KV format: an unknown one refuses the load before any weights are read), then
the model (refused if a layer keeps a cache the runner can neither page nor batch), the KV budget
sized from a one-page probe store, the store and runner for the format, the cost model, the
optional prefix cache, the scheduler, the request checkpoints, the result streams and the step
runner. It runs on the engine thread because MLX streams are thread-local: the arrays it creates
must belong to that thread.

Each part gets what it needs passed in, complete when built (the byte ledger exists before the
stores that ask it for workspace). No part calls back into the loop: the loop drives the parts
and applies what a step returns; only the engine's observers (the trace, the logits tap) go in.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

from capacity.formats import KVFormat, check_model_format, resolve_kv_format
from capacity.pricing import CostModel
from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.checkpoint.requests import RequestCheckpoints
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.kv import budget as kv_budget
from engine.kv.budget import ByteLedger, build_cost_model, resolve_budget_bytes
from engine.kv.pages import PagePool, pages_for
from engine.kv.prefix import PrefixCache, chain_root
from engine.runner.paged import check_supported_layers
from engine.sampling.structured import GrammarConstraints
from engine.sched.forecast import RateForecast
from engine.sched.scheduler import Scheduler
from engine.sched.seq import Seq
from engine.steps import StepRunner, WorkspacePermits, no_trace
from engine.streams import ResultStreams


@dataclass(frozen=True)
class EngineParts:
    """Everything `build` assembled; the engine thread owns all of it."""

    kv_format: str
    loaded: Any                  # engine.model.loader.LoadedModel
    kvstore: Any                 # engine.kv.store.KVStore
    runner: Any                  # engine.runner.paged.ModelRunner (or PackedModelRunner)
    cost_model: CostModel
    grammar: GrammarConstraints
    format_identity: str
    storage_identity: str
    layer_report: list
    scheduler: Scheduler
    checkpoints: RequestCheckpoints
    streams: ResultStreams
    steps: StepRunner
    counters: Counter            # the engine's own counters (steps, tokens, refusals)


def build(cfg: EngineConfig, *, trace: Callable[..., None] | None = None,
          logits_tap: Callable | None = None, pipeline_decode: bool = True,
          kernels: KernelChoices = DEFAULT_KERNELS) -> EngineParts:
    """Load the model and assemble the engine's parts (on the engine thread).

    `trace`, `logits_tap`: the engine's observers (see Engine). `pipeline_decode`: whether steady
    decode may be pipelined (tests switch it off); it is only used where the format and model allow
    it. `kernels`: the attention kernels the runner and the packed stores may use (the defaults are
    production's)."""
    from engine.kv.identity import layer_report, storage_identity
    from engine.kv.store import KVStore
    from engine.model.loader import load_model

    if cfg.compiled_decode is not None:   # the engine config overrides the backend default
        kernels = replace(kernels, compiled_decode=cfg.compiled_decode)
    if cfg.prefill_attention != "auto":
        kernels = replace(kernels, prefill_attention=cfg.prefill_attention)

    # Policy before any weights are read: an unknown value refuses the load (no fallback).
    kv_format = resolve_kv_format(cfg.model, cfg.kv_format, cfg.kv_format_overrides)
    loaded = load_model(cfg.model, dtype=cfg.dtype, allow_hub=cfg.allow_hub,
                        fuse=cfg.fuse_projections)
    check_supported_layers(loaded)   # before any KV memory is sized or allocated
    # A packed format the model cannot store (no full-attention layer, a head dim its rotation
    # cannot tile) is refused here, not stored native under its name or failed at warm-up.
    check_model_format(kv_format, [(g.kind, g.head_dim) for g in loaded.geometry.layers],
                       loaded.dtype_name)
    emit = trace if trace is not None else no_trace
    # The probe only measures a page: its stores never build a step, so never ask for workspace.
    probe = KVStore(loaded.geometry, 1, cfg.page_tokens, loaded.dtype,
                    layer_factory=store_for(kv_format, cfg, _no_workspace, kernels)[0])
    page_bytes, bytes_per_token = probe.page_bytes, probe.bytes_per_token
    # Native-tail formats: one native page per running sequence, allocated up front for
    # max_num_seqs sequences (a replica arena: see below).
    tail_pool = cfg.max_num_seqs * probe.tail_bytes_per_sequence
    del probe
    if page_bytes <= 0:
        raise EngineError(f"{cfg.model}: no layer keeps paged KV; nothing to budget")
    token_limit = cfg.max_model_len or int(loaded.config.get("max_position_embeddings") or 8192)
    budget = resolve_budget_bytes(
        cfg.kv_budget_bytes, cfg.kv_memory_fraction, page_bytes,
        max_useful_bytes=cfg.max_num_seqs * pages_for(token_limit, cfg.page_tokens) * page_bytes
        + tail_pool)
    num_pages = (budget - tail_pool) // page_bytes
    if num_pages < 1:
        raise EngineError(f"{cfg.model}: a KV budget of {budget} bytes cannot hold the native tail "
                          f"pool ({cfg.max_num_seqs} sequences x {tail_pool // cfg.max_num_seqs} "
                          f"bytes) and one page of {page_bytes} bytes")
    # The tail pool is priced as a fixed arena of the replica (CostModel.workspace.fixed), not
    # per request: it is allocated for max_num_seqs sequences whether they run or not, and a
    # per-request charge would let fewer, longer requests take more pages than the pool holds.
    cost_model = build_cost_model(
        budget_bytes=num_pages * page_bytes + tail_pool, bytes_per_token=bytes_per_token,
        page_tokens=cfg.page_tokens,
        fixed_bytes_per_request=loaded.geometry.state_bytes_per_sequence,
        max_num_seqs=cfg.max_num_seqs, token_limit=token_limit, arena_bytes=tail_pool)
    ledger = ByteLedger(cost_model)
    permits = WorkspacePermits(ledger, emit)
    factory, make_runner = store_for(kv_format, cfg, permits.permit, kernels)
    # The budget prices all `num_pages`; memory for them is taken as admitted work first needs
    # each (PagePool grows the store), so start-up allocates one slab, not the whole pool.
    kvstore = KVStore(loaded.geometry, num_pages, cfg.page_tokens, loaded.dtype,
                      layer_factory=factory,
                      initial_pages=kv_budget.first_slab_pages(num_pages, page_bytes,
                                                               cfg.max_num_seqs))
    runner = make_runner(loaded, kvstore, merge_pad_tokens=cfg.merge_pad_tokens,
                         prefill_width_bucket=cfg.prefill_width_bucket)
    head_dim = next((g.head_dim for g in loaded.geometry.layers if g.paged), 0)
    storage = storage_identity(kvstore)
    eos = set(getattr(loaded.tokenizer, "eos_token_ids", None) or ())
    pool = PagePool(num_pages, cfg.page_tokens,
                    on_free=kvstore.release_pages if tail_pool else None,
                    allocated=kvstore.allocated_pages, grow=kvstore.grow)
    prefix = root_of = None
    if cfg.enable_prefix_caching:
        if loaded.geometry.unpaged_layers:
            raise EngineError(f"{cfg.model}: prefix caching needs every layer's state in "
                              "pages; its recurrent layers summarize whole prompts")
        prefix = PrefixCache(pool)
        root_of = chain_roots(storage, loaded.fingerprint, cfg.page_tokens)
    scheduler = Scheduler(
        pool, ledger,
        max_num_seqs=cfg.max_num_seqs, max_step_tokens=cfg.max_step_tokens,
        max_waiting=cfg.max_waiting, eos_ids=eos,
        forecast=RateForecast(cfg.rate_ewma_alpha), prefix=prefix, root_of=root_of)
    checkpoints = RequestCheckpoints(
        cfg.model, kvstore, loaded.fingerprint,
        cfg.checkpoint_key.encode() if cfg.checkpoint_key else None, cfg.page_tokens,
        has_recurrent_state=runner.recurrent is not None)
    streams = ResultStreams(scheduler, loaded.tokenizer, checkpoints.save_finished)
    steps = StepRunner(
        runner=runner, kvstore=kvstore, permits=permits, emit=emit, logits_tap=logits_tap,
        # Pipelined decode needs no per-sequence state outside the pages (recurrent layers).
        # Every KV format: only pure decode steps are pipelined, and a decode step never asks
        # for workspace (packed formats' fused path is for prefill chunks only; a permit would
        # still be charged to its own step and released when that step retired).
        pipeline=pipeline_decode and runner.recurrent is None)
    return EngineParts(
        kv_format=kv_format, loaded=loaded, kvstore=kvstore, runner=runner,
        cost_model=cost_model,
        grammar=GrammarConstraints(loaded.tokenizer, loaded.geometry.vocab_size),
        format_identity=KVFormat(kv_format, head_dim, loaded.dtype_name, cfg.page_tokens).identity,
        storage_identity=storage, layer_report=layer_report(kvstore), scheduler=scheduler,
        checkpoints=checkpoints, streams=streams, steps=steps, counters=Counter())


def _no_workspace(nbytes: int) -> bool:
    return False


def chain_roots(storage: str, fingerprint: str, page_tokens: int) -> Callable[[Seq], bytes]:
    """The prefix-cache chain root of a request: one per tenant, computed once."""
    roots: dict[str, bytes] = {}

    def root_of(seq: Seq) -> bytes:
        if seq.tenant not in roots:
            roots[seq.tenant] = chain_root(storage, fingerprint, seq.tenant, page_tokens)
        return roots[seq.tenant]
    return root_of


def store_for(kv_format: str, cfg: EngineConfig, permit: Callable[[int], bool],
              kernels: KernelChoices = DEFAULT_KERNELS):
    """KV layer-store factory and runner maker for a format (packed formats hook attention);
    both get the same kernel choices."""
    from engine.kv.store import NativeLayerStore
    from engine.runner.paged import ModelRunner

    if kv_format == "native":
        return NativeLayerStore, partial(ModelRunner, kernels=kernels)
    from engine.attention.layers import packed_layer_factory
    from engine.runner.packed import PackedModelRunner

    return (packed_layer_factory(kv_format, cfg.prefill_mode, permit, kernels,
                                 tail_slots=cfg.max_num_seqs),
            partial(PackedModelRunner, kernels=kernels))
