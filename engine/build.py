"""Engine start-up: what the engine thread builds before it serves its first command.

Policy first (the KV format: an unknown one refuses the load before any weights are read), then
the model (refused if a layer keeps a cache the runner can neither page nor batch), the KV budget
sized from a one-page probe store, the store and runner for the format, the cost model, the
optional prefix cache, the scheduler and the request checkpoints. It runs on the engine thread
because MLX streams are thread-local: the arrays it creates must belong to that thread.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from capacity.formats import KVFormat, resolve_kv_format
from engine.bridge import Sink
from engine.kv.budget import ByteLedger, build_cost_model, resolve_budget_bytes
from engine.streams import LiveRequest
from engine.errors import EngineError
from engine.kv.pages import PagePool, pages_for
from engine.kv.prefix import PrefixCache, chain_root
from engine.request import Delta
from engine.checkpoint.requests import RequestCheckpoints
from engine.runner.paged import check_supported_layers
from engine.sched.forecast import RateForecast
from engine.sched.scheduler import Scheduler
from engine.sched.seq import Seq
from engine.sampling.structured import GrammarConstraints


class EngineStartup:
    """Engine mixin: `_start` sets every attribute the other parts of the engine thread use
    (model, KV store, runner, scheduler, checkpoints, counters, whether to pipeline decode)."""

    def _start(self) -> None:
        from engine.kv.store import KVStore
        from engine.model.loader import load_model
        from engine.attention.packed_store import layer_report, storage_identity

        cfg = self.cfg
        # Policy before any weights are read: an unknown value refuses the load (no fallback).
        self.kv_format = resolve_kv_format(cfg.model, cfg.kv_format, cfg.kv_format_overrides)
        loaded = load_model(cfg.model, dtype=cfg.dtype, allow_hub=cfg.allow_hub)
        check_supported_layers(loaded)   # before any KV memory is sized or allocated
        self._step_id: int | None = None     # the step whose graph is being built
        self._step_arrays: list = []         # its device results, dropped when it is released
        factory, runner_cls = store_for(self.kv_format, cfg.prefill_mode, self._permit)
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
        self._grammar_constraints = GrammarConstraints(loaded.tokenizer,
                                                       loaded.geometry.vocab_size)
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
        self._live: dict[str, LiveRequest] = {}
        self._outbox: list[tuple[Sink, Delta]] = []
        self._token_logprobs: dict = {}   # request id -> its latest sampled token's logprobs
        self._seq_ids = 0
        self._retired_step = -1
        self._counters: Counter[str] = Counter()
        # Pipelined decode needs steps that never ask for workspace (packed formats' fused
        # paths do) and no per-sequence state outside the pages (recurrent layers).
        self._pipeline = (self.pipeline_decode and self.kv_format == "native"
                          and self.runner.recurrent is None)
        self._publish_stats()


def store_for(kv_format: str, prefill_mode: str, permit: Callable[[int], bool]):
    """KV layer-store factory and runner class for a format (packed formats hook attention)."""
    from engine.kv.store import NativeLayerStore
    from engine.runner.paged import ModelRunner

    if kv_format == "native":
        return NativeLayerStore, ModelRunner
    from engine.runner.packed import PackedModelRunner
    from engine.attention.packed_store import packed_layer_factory

    return packed_layer_factory(kv_format, prefill_mode, permit), PackedModelRunner
