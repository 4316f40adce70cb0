"""Model runner: one forward over chunks of many sequences, K/V kept in the paged store.

The runner never decides policy: the scheduler says which tokens of which sequences run, and
which physical pages hold them; the runner builds indices, runs mlx-lm's unmodified model and
returns logits. Results are lazy MLX arrays; evaluating the logits also retires the step's KV
writes (every write feeds an attention read of the same call).

Mixing prefill chunks and decode rows: rows of one model call are right-padded to its longest
chunk (RoPE takes one offset per row, so tokens of different sequences cannot share a row).
A padded position costs as much compute as a real token, so `forward` groups chunks (longest
first): a chunk joins the current group while the group's total padding stays within
`merge_pad_tokens` (a conservative share of what one extra model call costs); otherwise it opens
a new call. Decode rows therefore batch together, and a long prefill chunk runs in its own call.
What a call costs depends on the device: on the CPU a batch-1 decode step costs a couple of dozen
prefill tokens (allowance 16), on a GPU an uncompiled call of a large model far more than a
padded token (`ACCELERATOR_MERGE_PAD_TOKENS`; measured: docs/lab/engine-notes.md). The decode
rows of a mixed step go through the compiled decode step where one exists.

A caller that reads tokens synchronously every step forgoes mlx-lm's overlap of graph building
with compute: pipelined decode passes the previous step's lazy token ids instead (step times
against mlx-lm: docs/lab/engine-runner-notes.md).
"""
from __future__ import annotations

import logging
import mlx.core as mx
import numpy as np

from engine.attention.choices import DEFAULT_KERNELS, KernelChoices
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.attention.cuda.decode_precompile import precompile
from engine.attention.layers import cache_class_for
from engine.attention.paged import PagedLayerCache, StepBatch, install_sdpa_hook
from engine.kv.store import KVStore
from engine.model.cpu_linear import install_linear_hook, skinny_linears
from engine.model.cpu_swiglu import install_swiglu_hook, numpy_swiglu
from engine.model.flat_decode import flat_decode_body
from engine.model.rope_table import RopeTable
from engine.model.loader import LoadedModel, ModelLoadError
from engine.runner.compiled_decode import CompiledDecode
from engine.runner.merged import MergedSteps
from engine.runner.tokens import input_tokens
from engine.sched.seq import Chunk

log = logging.getLogger("orchard.engine")

# Padding one call of a mixed step may carry, by device (EngineConfig.merge_pad_tokens=None).
CPU_MERGE_PAD_TOKENS = 16
ACCELERATOR_MERGE_PAD_TOKENS = 1024

# Layer kinds (engine/model/loader.py's probe) the runner can serve: attention it pages, and
# recurrent state it batches per sequence. Anything else ("other": e.g. a chunked-attention cache,
# or a rotating cache that pins leading tokens) would be attended wrongly, so the load is refused.
SUPPORTED_KINDS = ("full", "sliding", "recurrent")


class RecurrentStates:
    """Per-sequence native state of recurrent layers (mlx-lm ArraysCache), batched per call.

    Such state summarizes every earlier token, so it cannot be rebuilt from pages: a sequence
    must start at token 0 (no prefix reuse), and starting at 0 again resets it. Rows of a call
    are right-padded, which mlx-lm's ArraysCache handles through per-row `lengths` (the same
    mechanism its BatchGenerator uses for prefill).
    """

    def __init__(self, model, layers: list[int]):
        self.model = model
        self.layers = layers
        self._states: dict[int, list] = {}   # seq_id -> one cache per recurrent layer

    def batch(self, chunks: list[Chunk], lengths: np.ndarray) -> dict[int, object]:
        from mlx_lm.models.cache import make_prompt_cache
        for c in chunks:
            if c.start == 0:
                fresh = make_prompt_cache(self.model)
                self._states[c.seq_id] = [fresh[j] for j in self.layers]
            elif c.seq_id not in self._states:
                raise ValueError(f"sequence {c.seq_id}: recurrent layers hold no state for "
                                 f"its first {c.start} tokens; it must start at token 0")
        out = {}
        for k, j in enumerate(self.layers):
            per_seq = [self._states[c.seq_id][k] for c in chunks]
            merged = type(per_seq[0]).merge(per_seq)
            merged.prepare(lengths=lengths.tolist())
            out[j] = merged
        return out

    def keep(self, chunks: list[Chunk], batch: dict[int, object]) -> None:
        """Split the call's batched state back into each sequence's own."""
        for k, j in enumerate(self.layers):
            batch[j].finalize()
            for row, c in enumerate(chunks):
                self._states[c.seq_id][k] = batch[j].extract(row)

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)


def check_supported_layers(loaded: LoadedModel) -> None:
    """Refuse (ModelLoadError) a model with a layer whose cache the runner can neither page nor
    batch, naming each such layer, the mlx-lm cache class it uses and its probed kind."""
    bad = [g for g in loaded.geometry.layers if g.kind not in SUPPORTED_KINDS]
    if not bad:
        return
    from mlx_lm.models.cache import make_prompt_cache
    native = make_prompt_cache(loaded.model)   # empty cache objects: only their class is read
    by_cache: dict[tuple[str, str], list[int]] = {}
    for g in bad:
        by_cache.setdefault((type(native[g.index]).__name__, g.kind), []).append(g.index)
    what = "; ".join(f"layer{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))} keep"
                     f"{'' if len(ix) > 1 else 's'} a {cls} (cache kind {kind!r})"
                     for (cls, kind), ix in by_cache.items())
    raise ModelLoadError(
        f"model {loaded.path} is not supported: {what}. The engine serves layers whose cache is "
        "paged attention (full or sliding window) or per-sequence recurrent state only")


class ModelRunner:
    """Runs the model over paged KV. `kernels` picks the attention kernels its steps use (decode
    rows attend through the CUDA decode kernels where they apply, see `_kernel_decode_fits`;
    benches and tests pass other choices to compare with the gather path). Where it applies
    (`CompiledDecode.fits`, by default where the decode kernel runs) a decode step goes through
    one compiled function per shape instead (`self.compiled`, engine/runner/compiled_decode.py)."""

    cpu_merge_pad_tokens = CPU_MERGE_PAD_TOKENS

    def __init__(self, loaded: LoadedModel, kvstore: KVStore, merge_pad_tokens: int | None = None,
                 kernels: KernelChoices = DEFAULT_KERNELS,
                 prefill_width_bucket: int | None = None):
        check_supported_layers(loaded)
        if prefill_width_bucket is not None and prefill_width_bucket < 1:
            raise ValueError(f"prefill_width_bucket must be >= 1, got {prefill_width_bucket}")
        # Multi-token calls padded to a multiple of this width, keys to whole pages
        # (StepBatch's `width_bucket`; EngineConfig.prefill_width_bucket). None: exact shapes.
        self.prefill_width_bucket, self.kernels, self.loaded = prefill_width_bucket, kernels, loaded
        geometry = loaded.geometry
        self.kvstore = kvstore
        self.page_tokens = kvstore.page_tokens
        if merge_pad_tokens is None:
            merge_pad_tokens = (self.cpu_merge_pad_tokens if mx.default_device() == mx.cpu
                                else ACCELERATOR_MERGE_PAD_TOKENS)
        self.merge_pad_tokens = merge_pad_tokens
        self.model_calls = 0   # model calls issued (compiled or not): a step's count in traces
        self._windows = [g.window for g in geometry.layers]
        self._paged = set(geometry.paged_layers)
        self.recurrent = (RecurrentStates(loaded.model, list(geometry.unpaged_layers))
                          if geometry.unpaged_layers else None)
        # On the CPU, attention reads float32 pages in place instead of gathering a copy.
        self.in_place_decode = mx.default_device() == mx.cpu and kvstore.dtype == mx.float32
        self.cpu_softmax = self.in_place_decode and kernels.cpu_softmax
        self.cpu_decode = self.in_place_decode and kernels.cpu_decode
        self.cpu_prefill = self.in_place_decode and kernels.cpu_prefill
        self.rope_table = (RopeTable.for_model(loaded.model)
                           if self.in_place_decode and kernels.cpu_rope_table else None)
        self.cpu_swiglu = self.in_place_decode and kernels.cpu_swiglu
        self.cpu_linear = self.in_place_decode and kernels.cpu_linear
        install_sdpa_hook(loaded.model)
        if self.in_place_decode:   # each hook on only inside its context (_run, MergedSteps)
            install_swiglu_hook(loaded.model)
            install_linear_hook(loaded.model)
        self.direct = self._hook_reaches_every_layer()
        self.kernel_decode = kernels.decode_kernel and self._kernel_decode_fits()
        # Native decode kernel variants compiled now, not in traffic (KernelChoices.
        # precompile_decode): how many launches that took (0: none).
        self.precompiled = (self._precompile_decode_kernels()
                            if self.kernel_decode and kernels.precompile_decode else 0)
        # Multi-token calls attend through MLX ops instead of mx.fast's SDPA (KernelChoices.
        # prefill_attention; "auto": on CUDA, where SDPA builds a cuDNN plan per shape).
        self.prefill_ops = (kernels.prefill_attention == "ops"
                            or (kernels.prefill_attention == "auto"
                                and cuda_paged_decode.available()))
        # Per paged layer, what its step cache is made of (class, store, window), looked up
        # once instead of per layer and step; None for layers whose state is not paged.
        self.layer_caches = [(self.cache_class(i), kvstore.layer(i), w) if i in self._paged
                             else None for i, w in enumerate(self._windows)]
        # KernelChoices.flat_decode: one-token calls of Llama-family models on [rows, hidden]
        # (engine/model/flat_decode.py); None: the model's own forward.
        self.flat = (flat_decode_body(loaded.model)
                     if kernels.flat_decode and loaded.body is not None else None)
        wanted = (self.kernel_decode if kernels.compiled_decode is None
                  else kernels.compiled_decode)
        self.compiled = (CompiledDecode(self) if wanted and CompiledDecode.fits(self)
                         else None)
        # KernelChoices.merged_steps: a mixed step's groups in one pass over the weights
        # (engine/runner/merged.py); None where it does not fit.
        self.merged = MergedSteps.for_runner(self)

    def _precompile_decode_kernels(self) -> int:
        """Compile the native decode kernel's variants for each native paged layer's
        (group, head dim) once (cuda/decode_precompile.py). The query heads come from the
        model's config (num_attention_heads); a config without them compiles on first use."""
        config = self.loaded.config.get("text_config", self.loaded.config)
        heads = config.get("num_attention_heads")
        if not isinstance(heads, int):
            return 0
        own, tiled = self.kernels.decode_writes_own, self.kernels.native_decode == "tiled"
        shapes = {(heads // g.kv_heads, g.head_dim,
                   own and self.kvstore.layer(g.index).decode_writes_own)
                  for g in self.loaded.geometry.layers
                  if g.paged and self.cache_class(g.index) is PagedLayerCache
                  and g.kv_heads and heads % g.kv_heads == 0}
        try:
            return sum(precompile(group, dim, self.page_tokens, self.loaded.dtype,
                                  self.kvstore.dtype, writes, self.kernels.decode_warps, tiled)
                       for group, dim, writes in sorted(shapes))
        except Exception as e:  # noqa: BLE001 - the first step would compile them anyway
            log.warning("decode kernels not precompiled (compiled on first use): %s", e)
            return 0

    def _kernel_decode_fits(self) -> bool:
        """The kernels serve pages read in direct mode, on CUDA: native pages of their head
        sizes (engine/attention/cuda/paged_decode.py), packed ones where the layer's cache class
        says so (engine/attention/cuda/packed_decode.py)."""
        layers = [g for g in self.loaded.geometry.layers if g.paged]
        return (cuda_paged_decode.available() and self.direct
                and self.kvstore.dtype in (mx.bfloat16, mx.float16, mx.float32)
                and all(self._layer_kernel_fits(g) for g in layers))

    def _layer_kernel_fits(self, g) -> bool:
        cls = self.cache_class(g.index)
        if cls is PagedLayerCache:
            return g.head_dim == g.v_head_dim and g.head_dim in cuda_paged_decode.HEAD_DIMS
        return cls.kernel_decode_fits(self.kvstore.layer(g.index), self.kernels)

    def cache_class(self, layer: int) -> type[PagedLayerCache]:
        """The cache class attention reads this layer's store through (packed stores: codes)."""
        return cache_class_for(self.kvstore.layer(layer))

    def _hook_reaches_every_layer(self) -> bool:
        """Direct mode needs every paged layer to call mlx-lm's scaled_dot_product_attention
        (a model calling mx.fast directly would otherwise attend over fresh keys only)."""
        from mlx_lm.models.cache import make_prompt_cache
        probe = KVStore(self.loaded.geometry, 1, self.page_tokens, self.kvstore.dtype)
        step = StepBatch([Chunk(0, [0], 0, [0])], self.page_tokens)
        native = make_prompt_cache(self.loaded.model)
        caches = [PagedLayerCache(probe.layer(i), step, w, direct=True) if i in self._paged
                  else native[i] for i, w in enumerate(self._windows)]
        self.loaded.model(mx.array([[0]]), cache=caches)  # graph only; never evaluated
        return step.attended == len(self.loaded.geometry.paged_layers)

    def forward(self, chunks: list[Chunk], decode_tokens: mx.array | None = None) -> mx.array:
        """Float32 logits [len(chunks), vocab] of each chunk's last token (lazy).

        `decode_tokens` (optional): every chunk is one token and these are their ids as one
        int array [len(chunks)] (pipelined decode passes the previous step's sampled array
        whole instead of a slice per row)."""
        one_token = decode_tokens is not None or all(len(c.token_ids) == 1 for c in chunks)
        # A compiled step range-checks the page ids itself, as they first arrive (RowPages):
        # on long contexts checking every id of every row each step is most of its host work.
        self._validate(chunks, page_ids=not (one_token and self.compiled is not None))
        if one_token:
            if self.compiled is not None:
                out = self.compiled.forward(chunks, decode_tokens)
                if out is not None:
                    self.model_calls += 1
                    return out
                if self.compiled.failure is not None:   # else only this step runs uncompiled
                    log.warning("compiled decode steps off for %s: %s", self.loaded.path,
                                self.compiled.failure)
                    self.compiled = None
            groups = [list(range(len(chunks)))]   # one-token rows: always one call, in order
        else:
            groups = self._groups(chunks)
        if (len(groups) == 1 and groups[0] == list(range(len(chunks)))
                and (one_token or self.merged is None)):
            # One call in chunk order (every decode step; prompts merge where that fits).
            return self._run(chunks, last_only=True, tokens=decode_tokens).astype(mx.float32)
        if self.merged is not None:
            return self.merged.forward(chunks, groups)
        out: list[mx.array | None] = [None] * len(chunks)
        for n, group in enumerate(groups):
            logits = self._run_group([chunks[i] for i in group])
            for j, i in enumerate(group):
                out[i] = logits[j]
            if n + 1 < len(groups):
                self._settle_group(logits)
        return mx.stack(out).astype(mx.float32)

    def _run_group(self, group: list[Chunk]) -> mx.array:
        """One call of a mixed step: its one-token rows (the step's decode rows) through the
        compiled decode step when there is one, else an ordinary call."""
        if self.compiled is not None and all(len(c.token_ids) == 1 for c in group):
            out = self.compiled.forward(group, None)
            if out is not None:
                self.model_calls += 1
                return out
        return self._run(group, last_only=True)

    def _settle_group(self, logits: mx.array) -> None:
        """Queue one call's compute before the next call of the same step is built on it.

        Each call writes its K/V rows into the page arrays and its attention reads them. Left
        lazy, the next call's writes become a second consumer of the same array version, so
        MLX cannot update it in place and copies every page array of every layer, every mixed
        prefill + decode step (measured: docs/lab/engine-notes.md). Queued first, the earlier
        reads are ordered before the later writes and the update stays in place."""
        mx.async_eval(logits, *self.kvstore.arrays())

    def forward_all(self, chunks: list[Chunk]) -> list[mx.array]:
        """Float32 logits [len(token_ids), vocab] for every position of every chunk."""
        self._validate(chunks)
        out: list[mx.array | None] = [None] * len(chunks)
        groups = self._groups(chunks)
        for n, group in enumerate(groups):
            logits = self._run([chunks[i] for i in group], last_only=False)
            for j, i in enumerate(group):
                out[i] = logits[j, :len(chunks[i].token_ids)].astype(mx.float32)
            if n + 1 < len(groups):
                self._settle_group(logits)
        return out

    def release(self, seq_id: int) -> None:
        """Drop per-sequence state outside the pages (recurrent layers' native state)."""
        if self.recurrent is not None:
            self.recurrent.release(seq_id)

    def _validate(self, chunks: list[Chunk], page_ids: bool = True) -> None:
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        seen = set()
        for c in chunks:
            if c.seq_id in seen:
                raise ValueError(f"sequence {c.seq_id} appears twice in one forward")
            seen.add(c.seq_id)
            if len(c.token_ids) == 0 or c.start < 0:
                raise ValueError(f"sequence {c.seq_id}: empty chunk or negative start")
            need = -(-(c.start + len(c.token_ids)) // self.page_tokens)
            if len(c.page_table) < need:
                raise ValueError(f"sequence {c.seq_id}: page table has {len(c.page_table)} "
                                 f"pages, needs {need} for {c.start + len(c.token_ids)} tokens")
            if page_ids and (min(c.page_table[:need]) < 0
                             or max(c.page_table[:need]) >= self.kvstore.num_pages):
                raise ValueError(f"sequence {c.seq_id}: page id out of range")

    def _groups(self, chunks: list[Chunk]) -> list[list[int]]:
        """Greedy grouping by length (longest first) under the group's padding allowance."""
        order = sorted(range(len(chunks)), key=lambda i: -len(chunks[i].token_ids))
        groups: list[list[int]] = []
        width = padding = 0
        for i in order:
            n = len(chunks[i].token_ids)
            if groups and padding + width - n <= self.merge_pad_tokens:
                groups[-1].append(i)
                padding += width - n
            else:
                groups.append([i])
                width, padding = n, 0
        return groups

    def step_batch(self, chunks: list[Chunk]) -> StepBatch:
        """One call's StepBatch, with this runner's attention choices."""
        step = StepBatch(chunks, self.page_tokens, self.prefill_width_bucket)
        step.kernel_decode = self.kernel_decode and step.width == 1
        step.kernels = self.kernels
        step.cpu_softmax, step.cpu_decode, step.cpu_prefill = (self.cpu_softmax, self.cpu_decode,
                                                               self.cpu_prefill)
        step.rope_table = self.rope_table
        step.prefill_ops = self.prefill_ops
        return step

    def step_caches(self, step: StepBatch, native: dict) -> list:
        """One call's per-layer caches (`native`: recurrent layers' states, by layer)."""
        direct, in_place = self.direct, self.in_place_decode
        return [native[i] if lc is None else lc[0](lc[1], step, lc[2], direct, in_place)
                for i, lc in enumerate(self.layer_caches)]

    def _run(self, chunks: list[Chunk], last_only: bool,
             tokens: mx.array | None = None) -> mx.array:
        self.model_calls += 1
        step = self.step_batch(chunks)
        if tokens is not None and step.width == 1:
            inputs = tokens.reshape(-1, 1).astype(mx.int32)
        else:
            inputs = input_tokens(chunks, step.width)
        native = self.recurrent.batch(chunks, step.lengths) if self.recurrent else {}
        caches = self.step_caches(step, native)
        with numpy_swiglu(self.cpu_swiglu), skinny_linears(self.cpu_linear):
            out = self.call_model(inputs, caches, step, last_only)
        if native:
            self.recurrent.keep(chunks, native)
        return out

    def call_model(self, inputs: mx.array, caches: list, step: StepBatch, last_only: bool):
        """The model over `caches` (one per layer): logits of every position, or of each row's
        last one (`last_only`; the LM head then runs on those rows only)."""
        loaded = self.loaded
        if not last_only:
            return loaded.model(inputs, cache=caches)
        if step.width == 1:   # one position per row: a slice, no index arrays
            if self.flat is not None:
                return loaded.head(self.flat(inputs[:, 0], caches))
            if loaded.body is not None:
                return loaded.head(loaded.body(inputs, caches)[:, 0])
            return loaded.model(inputs, cache=caches)[:, 0]
        rows = mx.arange(step.size)
        last = mx.array((step.lengths - 1).astype(np.int32))
        if loaded.body is not None:
            # Apply the LM head to each row's last position only (prefill rows are long).
            return loaded.head(loaded.body(inputs, caches)[rows, last])
        return loaded.model(inputs, cache=caches)[rows, last]
