"""Decode steps traced once per shape and replayed (`mx.compile`): no model Python per step.

Why: on the H200 a small model's batch-1 decode step is host work, not arithmetic. mlx-lm's model
code runs its Python per layer every step, then MLX issues every node of the graph it built
(numbers: docs/lab/engine-runner-notes.md). A compiled step runs that Python once per shape (the
trace) and afterwards replays the recorded graph from C++; it also fuses chains of elementwise
operations (SwiGLU's silu and product, the write-slot arithmetic) into single kernels, so fewer
nodes are issued.

A trace may not capture a host value that changes from step to step, so everything a step
varies enters as arrays:
- `tokens` [B]: the rows' input ids (pipelined decode passes the previous step's sampled array);
- `table` [B * (4 + P)] int32, flat: the rows' starts (keys already in KV, which is also their
  RoPE positions), their ends (start + 1: keys attended after the write), their write slots'
  pages and offsets in the page, then each row's page table padded to P pages. P is a power of
  two (`bucket_pages`), so a growing row re-traces only when it crosses a bucket, and the whole
  step costs one host-to-device upload. Every part is a contiguous slice of it, so the step
  reads them as views: no arithmetic, gather or copy of its own before the model (the key mask
  is derived from the ends on the device where a step needs one). With a native-tail store
  (page keys: engine/kv/page_key_store.py) two more rows follow those four: each row's tail
  slot as the step began (-1: none) and the slot its new row goes to, planned on the host per
  step (`TailMap.decode_slots`, outside the trace) and read by the store and the kernel inside.
The page arrays are inputs and outputs of the compiled function (it cannot keep state): each
store gets its arrays back after the call (`adopt`). Where the CUDA kernels write the step's
keys themselves (`KernelChoices.decode_writes_own`: the native and the v2 packed decode
kernels, else the packed write kernel's in-place variant) the outputs are the inputs, written
in place behind MLX's back; where a store scatters (the CPU, or that choice off), they are the
scatters' outputs.

Attention inside the trace: the CUDA decode kernel where the runner uses it, with its split plan
fixed by the bucket's capacity (P * page_tokens keys; a split past a row's end does no work), or
else the pages gathered and masked by row end on the device (any backend: the CPU suite checks
the compiled step through it).

Which steps: every row decodes one token; every layer is paged full attention (no window, no
recurrent state); every store can stand in for itself inside a trace (`can_trace`, `traced`,
`adopt`: native pages; packed pages of codes-only formats where the CUDA kernels attend).
Traces are cached per (rows, P, token dtype); each new shape costs one trace (about one
uncompiled step plus MLX's compile passes, far more for a process's very first, which compiles
MLX's kernels). So the rows are padded to a
bucket too (`bucket_rows`: 1, 2, 4, 8, then steps of 4 to 32 and of 8 beyond), by repeating the
last row: a repeated row computes what its original does and writes the same values to the
same slot, and its logits are dropped. A served batch's size moves by one row at a time, so
without buckets every size it passes through is a trace.

A compiled step's logits are bit-identical to an uncompiled step's. On the CPU the arithmetic is
the step and the in-place page reads of the uncompiled path win at batch > 1, so the CPU keeps
uncompiled steps by default. What compiling gained on the H200: docs/lab/engine-runner-notes.md.
"""
from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np

from engine.attention.choices import KernelChoices
from engine.attention.cuda import page_key_write
from engine.attention.cuda.paged_decode import asked_warps
from engine.attention.paged import PagedLayerCache, View
from engine.kv.store import KVStore
from engine.runner.row_pages import RowPages
from engine.runner.tokens import input_tokens
from engine.sched.seq import Chunk


class DecodeRunner(Protocol):
    """What a compiled step reads of the runner that owns it (engine/runner/paged.py's
    ModelRunner): declared here, so this module needs nothing from the runner's."""

    loaded: object                 # engine.model.loader.LoadedModel
    kvstore: KVStore
    page_tokens: int
    kernels: KernelChoices
    kernel_decode: bool
    direct: bool
    recurrent: object              # RecurrentStates, or None
    layer_caches: list             # per layer: (cache class, store, window), or None

    def cache_class(self, layer: int) -> type[PagedLayerCache]: ...

    def call_model(self, inputs: mx.array, caches: list, step, last_only: bool) -> mx.array: ...

# The smallest page-table width a trace is made for: short contexts share one trace.
MIN_BUCKET_PAGES = 4


def bucket_rows(rows: int) -> int:
    """The padded row count a trace is made for: 1, 2, 4, 8, then multiples of 4 up to 32 and
    of 8 beyond (at most a third more rows than asked past 8: 9 -> 12, 33 -> 40), so 64 rows
    take 14 shapes, not 64."""
    if rows <= 8:
        return 1 << (max(rows, 1) - 1).bit_length()
    step = 4 if rows <= 32 else 8
    return -(-rows // step) * step


def bucket_pages(pages: int) -> int:
    """The padded page-table width for rows needing up to `pages` pages: a power of two."""
    return max(MIN_BUCKET_PAGES, 1 << (max(pages, 1) - 1).bit_length())


class DeviceSlots:
    """Where each row's new token goes, as device arrays (no host coordinates inside a trace)."""

    def __init__(self, page: mx.array, offset: mx.array):
        self.page = page        # [B] int32
        self.offset = offset    # [B] int32
        self._by_heads: dict = {}   # per-step index forms stores derive (as `Slots` keeps them)
        # Native-tail stores: each row's tail slot as the step began (-1: none) and the slot
        # its new row goes to, [B] int32 (None without such a store; see the module docstring).
        self.tail_before: mx.array | None = None
        self.tail_write: mx.array | None = None
        # Their write as one CUDA kernel (cuda/page_key_write.py; KernelChoices.page_key_write),
        # or None: MLX ops. A module, passed in: engine/kv imports nothing of engine/attention.
        self.page_key_writer = None

    def only_slot(self) -> None:
        return None   # the store must scatter by array, never slice at host coordinates

    def token_major(self, heads: int) -> tuple[mx.array, mx.array, mx.array]:
        """(head, page, offset) indices broadcasting to [B, heads, 1] (`Slots.token_major`),
        built once per step (every layer's write shares them: one arange, not one per layer)."""
        if heads not in self._by_heads:
            self._by_heads[heads] = (mx.arange(heads, dtype=mx.int32)[None, :, None],
                                     self.page[:, None, None], self.offset[:, None, None])
        return self._by_heads[heads]


class DeviceDecodeStep:
    """The part of `StepBatch` a decode step's caches read, built from the step's table on the
    device inside a trace."""

    width = 1
    valid = None
    cpu_softmax = False   # one query per row: mx.softmax inside the trace, never NumPy
    cpu_decode = False    # nor the Numba kernel: a trace holds MLX ops only
    cpu_prefill = False   # (one query per row: never the prefill kernel either)

    def rotation(self):
        return None           # RoPE by the layers' own modules, inside the trace
    prefill_ops = False   # one query per row: never the prefill attention paths

    def __init__(self, table: mx.array, rows: int, page_tokens: int, kernel_decode: bool,
                 kernels, tails: bool = False):
        # `table`: the flat layout of the module docstring. Each part is a contiguous slice
        # (a view): the page rows are what a kernel that wants row-contiguous inputs takes as
        # they are, and no part needs a kernel to be derived.
        b = rows
        pages = table[head_rows(tails) * b:].reshape(b, -1)
        self.size = b
        self.page_tokens = page_tokens
        self.offset = table[:b]                   # RoPE position of each row's token
        self.ends = table[b:2 * b]                # keys each row attends to after the write
        self.slots = DeviceSlots(table[2 * b:3 * b], table[3 * b:4 * b])
        self.tail_before = None   # read by page-key attention (PackedLayerCache._tail_slots)
        if tails:
            self.tail_before = self.slots.tail_before = table[4 * b:5 * b]
            self.slots.tail_write = table[5 * b:6 * b]
            self.slots.page_key_writer = page_key_write.chosen(kernels)
        self.longest = pages.shape[1] * page_tokens   # the bucket's capacity: fixes the split plan
        self.kernel_decode = kernel_decode
        self.kernels = kernels
        self.attended = 0
        self._view = View(None, None, pages, None)
        self._mask = None

    def view(self, window: int | None) -> View:
        if window is not None:
            raise ValueError("a compiled decode step serves full-attention layers only")
        return self._view

    def sdpa_mask(self, view: View) -> mx.array:
        """[B, 1, 1, P*T]: key j of row b is live when j < ends[b] (padding pages are hidden).
        Also `page_mask`: the view's keys are its whole padded pages either way."""
        if self._mask is None:
            keys = mx.arange(view.pages.shape[1] * self.page_tokens, dtype=mx.int32)
            self._mask = (keys[None, :] < self.ends[:, None])[:, None, None, :]
        return self._mask

    page_mask = sdpa_mask


def head_rows(tails: bool) -> int:
    """Rows of the table before the page tables: starts, ends, write pages, offsets, and with
    a native-tail store the two tail-slot rows."""
    return 6 if tails else 4


class TraceFailed(Exception):
    """The model's code could not be traced as a compiled decode step (the runner then keeps
    uncompiled steps; nothing was written)."""


class CompiledDecode:
    """A runner's decode steps through one compiled function (see the module docstring)."""

    def __init__(self, runner: DecodeRunner):
        self.runner = runner
        self.page_tokens = runner.page_tokens
        self.layers = [(i, runner.kvstore.layer(i))
                       for i in runner.loaded.geometry.paged_layers]
        # Rows' page ids kept between steps, range-checked as they arrive (the runner leaves
        # the check of a compiled step's ids to it: engine/runner/row_pages.py).
        self.row_pages = RowPages(runner.kvstore.num_pages)
        self._tables: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.traces = 0   # how many shapes were traced (tests and benches read it)
        self.failure: str | None = None   # why a trace failed, if one did
        # `KernelChoices.compiled_greedy`: the last step's argmax tokens [rows] int32 (lazy),
        # the compute-dtype logits' argmax inside the compiled function; None otherwise.
        self.greedy: mx.array | None = None
        self._greedy = runner.kernels.compiled_greedy
        # The native tail map the page-key stores share (at most one: `fits`), planned per
        # step on the host by `inputs`; None without such stores.
        self.tail_map = next(iter(_tail_maps(runner)), None)
        self._fn = mx.compile(self._step)

    @staticmethod
    def fits(runner: DecodeRunner) -> bool:
        """Every layer paged full attention in direct mode; every store able to stand in for
        itself in a trace (`can_trace`); and layers with their own cache class (packed) only
        where their decode steps attend through a CUDA kernel (their MLX-op path builds masks
        from host values)."""
        geometry = runner.loaded.geometry
        if not (runner.direct and runner.recurrent is None
                and all(g.paged and g.window is None for g in geometry.layers)):
            return False
        kernel_only = runner.kernel_decode and not runner.kernels.decode_tiles
        if len(_tail_maps(runner)) > 1:
            return False
        return all(runner.kvstore.layer(g.index).can_trace
                   and (runner.cache_class(g.index) is PagedLayerCache or kernel_only)
                   for g in geometry.layers)

    def forward(self, chunks: list[Chunk], tokens: mx.array | None) -> mx.array | None:
        """Float32 logits [B, vocab] of one-token rows (lazy), as `ModelRunner.forward`; None
        when this shape's trace failed (`TraceFailed`, `failure` says why) or this step's tail
        plan cannot run in a trace (`failure` None): the caller runs the step uncompiled."""
        self.greedy = None   # a step that falls back uncompiled leaves none
        planned = self.tail_map.state() if self.tail_map is not None else None
        tokens, table = self.inputs(chunks, tokens)
        if planned is not None and self.tail_map.reused:
            # A new page took a slot a filling row gave back (no other was free): the traced
            # write kernel writes tails in place (engine/attention/cuda/page_key_write.py), so
            # this one step runs uncompiled, where the tails are written after attention.
            self.tail_map.restore(planned)
            return None
        arrays = [a for _, store in self.layers for a in store.arrays()]
        try:
            out = self._fn(tokens, table, *arrays)
        except TraceFailed:
            # Only the stand-ins saw the trace: the stores still hold their arrays, unwritten;
            # the tail map goes back to before this step's plan (the uncompiled step plans it).
            if planned is not None:
                self.tail_map.restore(planned)
            return None
        del arrays   # the stores' old arrays must be the graph's only references (in place)
        rows = len(chunks)
        if self._greedy:
            greedy, out = out[0], out[1:]
            self.greedy = greedy if tokens.shape[0] == rows else greedy[:rows]
        for (_, store), written in self._per_store(out[1:]):
            store.adopt(written)
        return out[0] if tokens.shape[0] == rows else out[0][:rows]

    def inputs(self, chunks: list[Chunk], tokens: mx.array | None) -> tuple[mx.array, mx.array]:
        """The compiled function's step inputs for these rows: (tokens [padded rows], the flat
        table of the module docstring), padded to the shape's row bucket."""
        t, rows = self.page_tokens, len(chunks)
        need = [c.start // t + 1 for c in chunks]
        width = bucket_pages(max(need))
        padded = bucket_rows(rows) if self.runner.kernels.compiled_row_buckets else rows
        # One host buffer per shape (mx.array copies it): a fresh 8 x 4K table cost more to
        # allocate and fault in than to fill. `head` and `pages` are views of the flat `table`.
        h = head_rows(self.tail_map is not None)
        bufs = self._tables.get((padded, width))
        if bufs is None:
            table = np.empty(padded * (h + width), dtype=np.int32)
            bufs = self._tables[padded, width] = (
                table, table[:h * padded].reshape(h, padded),
                table[h * padded:].reshape(padded, width))
        table, head, pages = bufs
        for i, (c, n, ids) in enumerate(zip(chunks, need, self.row_pages.arrays(chunks, need))):
            head[:4, i] = (c.start, c.start + 1, ids[n - 1], c.start % t)
            pages[i, :n] = ids
            pages[i, n:] = ids[0]   # any live page: the row's end bounds its keys
        if self.tail_map is not None:   # the real rows only: padding repeats the last one
            head[4:, :rows] = self.tail_map.decode_slots(head[2, :rows], head[3, :rows])
        head[:, rows:] = head[:, rows - 1:rows]   # padding repeats the last row (docstring)
        pages[rows:] = pages[rows - 1]
        if tokens is None:
            tokens = input_tokens(chunks, 1)
        tokens = tokens.reshape(-1)
        if padded > rows:
            tokens = mx.concatenate([tokens, mx.repeat(tokens[-1:], padded - rows)])
        return tokens, mx.array(table)

    def _per_store(self, flat):
        """(layer, store) pairs with their part of `flat` (every store's arrays in order)."""
        k = 0
        for layer in self.layers:
            n = len(layer[1].arrays())
            yield layer, list(flat[k:k + n])
            k += n

    def _step(self, tokens: mx.array, table: mx.array, *arrays: mx.array) -> list[mx.array]:
        """Traced once per shape: the model over stand-in stores holding the input arrays."""
        self.traces += 1
        try:
            return self._trace(tokens, table, arrays)
        except Exception as e:  # noqa: BLE001 - any model code the trace cannot follow
            self.failure = f"{type(e).__name__}: {e}"
            raise TraceFailed(self.failure) from e

    def _trace(self, tokens: mx.array, table: mx.array, arrays) -> list[mx.array]:
        runner = self.runner
        step = DeviceDecodeStep(table, tokens.shape[0], self.page_tokens, runner.kernel_decode,
                                runner.kernels, tails=self.tail_map is not None)
        stores = {i: store.traced(given) for (i, store), given in self._per_store(arrays)}
        caches = [cache_class(stores[i], step, None, True)
                  for i, (cache_class, _, _) in enumerate(runner.layer_caches)]
        inputs = tokens.astype(mx.int32)[:, None]
        # The native decode kernel's warps per block (KernelChoices.decode_warps) reach it
        # through a context variable: the attention call site passes split choices only.
        # `call_model` takes the runner's flat Llama forward where it has one
        # (KernelChoices.flat_decode, engine/model/flat_decode.py): fewer nodes to replay.
        with asked_warps(runner.kernels.decode_warps):
            raw = runner.call_model(inputs, caches, step, last_only=True)
        logits = raw.astype(mx.float32)
        # Greedy tokens from the compute-dtype logits: the float32 cast is exact and monotone,
        # so the index (first maximum on ties) is the one `sample` takes from float32 logits,
        # and a caller that reads only these leaves the cast unevaluated.
        greedy = [mx.argmax(raw, axis=-1).astype(mx.int32)] if self._greedy else []
        return greedy + [logits] + [a for i, _ in self.layers for a in stores[i].arrays()]


def _tail_maps(runner: DecodeRunner) -> list:
    """The distinct native tail maps (engine/kv/tails.py) of the runner's paged stores."""
    maps = {}
    for g in runner.loaded.geometry.layers:
        tails = runner.kvstore.layer(g.index).tails if g.paged else None
        if tails is not None:
            maps[id(tails)] = tails
    return list(maps.values())
