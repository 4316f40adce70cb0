"""The mlx-lm cache object of a packed layer for one forward call.

mlx-lm layers call `cache.update_and_fetch(k, v)` and then `scaled_dot_product_attention`, which
the runner's hook (engine.attention.paged.install_sdpa_hook) routes to `cache.attend`. A packed
layer must (1) write the new rows quantized, (2) hand attention the fresh rows in full precision,
and (3) read earlier history packed: `update_and_fetch` does (1) and returns the fresh rows,
`attend` does (2) and (3). engine.attention.layers maps packed stores to this class, so the plain
ModelRunner builds it for packed layers and PagedLayerCache for native ones.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from capacity.formats import KVFormatError
from engine.attention import cpu_page_key_decode, cpu_prefill, cpu_softmax
from engine.attention.choices import DEFAULT_KERNELS
from engine.attention.cuda import packed_decode as cuda_packed_decode
from engine.attention.cuda import page_key_decode as cuda_page_key_decode
from engine.attention.cuda import page_key_dequant as cuda_page_key_dequant
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.attention.cuda import packed_dequant as cuda_packed_dequant
from engine.attention.cuda import packed_prefill as cuda_packed_prefill
from engine.attention.packed import attention_of
from engine.attention.paged import PagedLayerCache, StepBatch
from engine.kv.page_quant import dequantize_pages
from engine.kv.quant import dequantize

# With the CPU prefill kernel off (KernelChoices.cpu_prefill), page-key prefill chunks over at
# most this many history keys attend on the CPU as native prefill did, over a dequantized copy
# (`_cpu_page_key_prefill_attend`): the size of the tile the direct path's tiled history unpacks
# on the CPU anyway (engine/attention/packed.py).
CPU_PREFILL_COPY_KEYS = 512


class PackedLayerCache(PagedLayerCache):
    """One packed full-attention layer over one forward call."""

    # Set by `plan_ahead`: one row group of a merged mixed step (engine/runner/merged.py),
    # whose write and attention are not adjacent; `_tail_rows`: its write's pending tail rows.
    _merged = False
    _tail_rows = None

    def __init__(self, store, step: StepBatch, window, direct: bool = False,
                 in_place_decode: bool = False):
        if not direct:
            # Without the hook the model would attend over the fresh rows only: refuse, loudly.
            raise KVFormatError("packed KV needs every paged layer to attend through the SDPA "
                                "hook; this model's attention does not (runner is in gather mode)")
        super().__init__(store, step, window, direct, in_place_decode)

    def _decode_writes_own(self) -> bool:
        """Whether the base class's update_and_fetch hands this decode step's rows to attend()
        unwritten (the mechanism the native kernel uses): the step attends through the CUDA
        packed decode kernel and the store's pool may be written in place. attend() then has
        the v2 kernel store them itself, or the write kernel's in-place variant."""
        if self.store.whole_pages:
            return self._page_key_writes_own()
        return (self._kernel_decode() and not self.step.kernels.decode_tiles
                and self.step.kernels.decode_writes_own and self.store.decode_writes_own)

    def _page_key_writes_own(self) -> bool:
        """A page-key layer's decode rows stored by the page-key decode kernel itself
        (KernelChoices.page_key_own_write): in compiled steps only (their slots carry the
        host-planned tail slots), where the write kernel would otherwise take them."""
        slots, kernels = self.step.slots, self.step.kernels
        return (self._kernel_decode() and kernels.page_key_own_write is not False
                and slots.tail_write is not None and slots.page_key_writer is not None
                and slots.page_key_writer.serves(self.store))

    @staticmethod
    def kernel_decode_fits(store, kernels=DEFAULT_KERNELS) -> bool:
        """Whether decode steps of this layer may attend through a CUDA decode kernel (the
        runner asks; it also requires CUDA and one query token per row)."""
        if store.whole_pages:   # page keys: their own kernel, where KernelChoices allows it
            fmt = store.fmt
            return (kernels.page_key_kernel is not False
                    and cuda_page_key_decode.supports(fmt.k_bits, fmt.v_bits,
                                                      store.geometry.head_dim, 1,
                                                      store.page_tokens))
        # The packed kernels read the v1 layout only (64-channel groups, no native rows).
        return (store.fmt.codes_only
                and cuda_packed_decode.supports(store.fmt.k_bits, store.fmt.v_bits,
                                                store.geometry.head_dim))

    def plan_ahead(self) -> None:
        """Make this call's per-step plans now: called by a merged mixed step for every row
        group in turn before any group writes (engine/runner/merged.py). Each layer there
        writes every group, then attends every group, so plans made lazily would be wrong: the
        shared TailMap's `before` would be the last group's when an earlier group attends, and
        a later group's write would flush an earlier group's tail rows before that group read
        its tails. So: the tail plan, page-key fill plan and tail slots as this group began
        (the same, group by group, as the per-group calls make them), and from now on this
        cache keeps its write's tail rows aside until its own attention."""
        self._merged = True
        self.store.plan_step(self.step.slots)
        if self.store.tails is not None:
            self._tail_before()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = super().update_and_fetch(keys, values)
        if self._merged:   # held until this group attends (`plan_ahead`)
            self._tail_rows = self.store.detach_tail_rows()
        return out

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        if self._merged:   # this group's tail rows: its attention flushes them after reading
            self.store.attach_tail_rows(self._tail_rows)
            self._tail_rows = None
        self.step.attended += 1
        own, self._own = self._own, None
        kernels = self.step.kernels
        if own is not None and self.store.whole_pages:
            if sinks is None and self._page_key_kernel_serves(queries, keys):
                return self._page_key_attend(queries, keys, values, scale, own=True)
            self.store.write_decode(self.step.slots, *own)   # not through the kernel: now
            own = None
        if own is not None:
            fmt, group = self.store.fmt, queries.shape[1] // keys.shape[1]
            if sinks is None and cuda_packed_decode.writes_own(
                    kernels.packed_decode, fmt.k_bits, fmt.v_bits, keys.shape[-1], group):
                # The v2 decode kernel stores the rows into the pool itself: no write launch.
                return self._kernel_attend(queries, keys, values, scale, own=True)
            keys_own, values_own = own   # the write kernel's in-place variant stores them
            b, h, _, d = keys_own.shape
            self.store.write(self.step.slots, keys_own.reshape(b, h, d),
                             values_own.reshape(b, h, values_own.shape[-1]), in_place=True)
        # The CUDA kernels read the v1 layout only; other formats attend through MLX ops.
        if sinks is None and self.store.fmt.codes_only and cuda_packed_prefill.applies(
                self.store, self.step, queries, self._kernel_decode(), kernels):
            # CUDA: packed pages read by page table inside one tensor-core kernel.
            if queries.shape[2] > 1:
                attention_of(self.store).counters.direct += 1   # it is the direct path there
            bounds, longest = cuda_packed_prefill.step_bounds(self.step, self.view)
            if queries.shape[2] > 1 and kernels.prefill_path == "dequant":
                # The default: history dequantized by one kernel, then native's SDPA.
                return cuda_packed_dequant.dequant_prefill_attention(
                    queries, keys, values, self.store.pool, self.store.layout,
                    self.store.fmt.k_bits, self.store.fmt.v_bits, self.view.pages, bounds,
                    longest, scale, mask=cuda_packed_dequant.step_mask(self.step, self.view))
            return cuda_packed_prefill.packed_prefill_attention(
                queries, keys, values, self.store.pool, self.store.layout, self.store.fmt.k_bits,
                self.store.fmt.v_bits, self.view.pages, bounds, longest, scale,
                target_blocks=kernels.prefill_split_target)
        if sinks is None and self._page_key_prefill(queries):
            return self._page_key_prefill_attend(queries, keys, values, scale)
        if sinks is None and self._kernel_decode():
            if not self.store.whole_pages:
                return self._kernel_attend(queries, keys, values, scale)
            if self._page_key_kernel_serves(queries, keys):
                return self._page_key_attend(queries, keys, values, scale)
            # A GQA group past the kernel's: the MLX path below (it builds its own masks).
        if sinks is None and self._cpu_page_key_kernel_prefill(queries):
            # CPU, float32: page-key prompt chunks through native's prefill kernel, which reads
            # codes and native tails where they lie (it flushes the step's tail rows after).
            attention_of(self.store).counters.direct += 1   # the direct path's work
            return cpu_prefill.page_key_prefill_attention(self.store, self.step, self.view,
                                                          queries, keys, values, scale,
                                                          self._tail_slots())
        if sinks is None and self._cpu_page_key_prefill(queries):
            return self._cpu_page_key_prefill_attend(queries, keys, values, scale)
        if cpu_page_key_decode.applies(self.store, self.step, self.view, queries, sinks):
            # CPU, float32: page-key decode rows through one Numba kernel that reads codes and
            # native tails where they lie (it flushes the step's tail rows after, as below).
            attention_of(self.store).counters.direct += 1   # the direct path's work
            return cpu_page_key_decode.decode_attention(self.store, self.step, self.view,
                                                        queries, keys, values, scale,
                                                        self._tail_slots())
        ctx = self._context()
        hist, hist_mask, new_mask = ctx.history(self.store), ctx.hist_mask, ctx.new_mask
        rows = self.store.sink_rows
        if rows and ctx.span:
            # The first `rows` tokens of every history page (a sequence's attention sinks among
            # them) are attended from their native copy as extra fresh-like keys; their packed
            # copies are masked out.
            sk, sv = self.store.gather_sinks(ctx.pages)
            keys = mx.concatenate([sk.astype(keys.dtype), keys], axis=2)
            values = mx.concatenate([sv.astype(values.dtype), values], axis=2)
            hist_mask, new_mask = ctx.sink_masks(rows)
        tails = self.store.tails
        if tails is not None and ctx.span:
            # Each row's partial last page (as the step began) is attended from its native copy,
            # as extra fresh-like keys; history hides that page's packed rows.
            tk, tv = self.store.gather_tail(self._tail_before())
            keys = mx.concatenate([tk.astype(keys.dtype), keys], axis=2)
            values = mx.concatenate([tv.astype(values.dtype), values], axis=2)
            hist_mask, new_mask = ctx.tail_masks(self.store.whole_pages)
        out = attention_of(self.store)(queries, hist, keys, values, scale=scale, new_mask=new_mask,
                                   hist_mask=hist_mask, sinks=sinks,
                                   cpu_softmax=self.step.cpu_softmax)
        if tails is not None:
            self.store.flush_tail()   # this step's new tail rows, after the old tails were read
        return out

    def _kernel_attend(self, queries, keys, values, scale, own: bool = False) -> mx.array:
        """A decode step through the CUDA packed decode kernel (`own`: it stores the rows)."""
        kernels = self.step.kernels
        return cuda_packed_decode.packed_decode_attention(
            queries, keys, values, self.store.pool, self.store.layout, self.store.fmt.k_bits,
            self.view.pages, self.step.ends, self.step.longest, scale,
            kernels.decode_split_target, version=kernels.packed_decode,
            min_keys=kernels.decode_split_min_keys, own=own)

    def _page_key_prefill(self, queries) -> bool:
        """Whether this call is a page-key prefill chunk over history that the CUDA dequant
        kernel serves (KernelChoices.page_key_prefill; None: on CUDA)."""
        store, choice = self.store, self.step.kernels.page_key_prefill
        return (store.whole_pages and queries.shape[2] > 1 and choice is not False
                and bool(self.step.starts.max() > 0) and cuda_paged_decode.available()
                and attention_of(store).prefill_mode == "direct"
                and cuda_page_key_dequant.supports(store.fmt.k_bits, store.fmt.v_bits,
                                                   store.geometry.head_dim, store.page_tokens))

    def _cpu_page_key_kernel_prefill(self, queries) -> bool:
        """Whether this call is a page-key prompt chunk that the CPU prefill kernel serves
        (KernelChoices.cpu_prefill on a CPU float32 step, direct prefill mode, no window or
        sink rows, code widths the kernel reads)."""
        return (self.step.cpu_prefill and queries.shape[2] > 1
                and cpu_page_key_decode.reads_in_place(self.store, self.step, self.view)
                and attention_of(self.store).prefill_mode == "direct")

    def _cpu_page_key_prefill(self, queries) -> bool:
        """Whether this call is a page-key prefill chunk over a short history on the CPU
        (the runner's float32 NumPy-softmax flag, direct prefill mode, no window or sink rows,
        at most CPU_PREFILL_COPY_KEYS keys of history pages)."""
        store, step = self.store, self.step
        if not (store.whole_pages and step.cpu_softmax and queries.shape[2] > 1
                and not step.kernel_decode and self.view.window is None and not store.sink_rows
                and attention_of(store).prefill_mode == "direct"):
            return False
        span = int(step.starts.max())
        return 0 < -(-span // store.page_tokens) * store.page_tokens <= CPU_PREFILL_COPY_KEYS

    def _cpu_page_key_prefill_attend(self, queries, keys, values, scale) -> mx.array:
        """A prefill chunk over page-key history as native prefill on the CPU: the history
        (full pages dequantized from their codes, the partial page from its native tail as the
        step began, the step's own keys last) through native's NumPy-softmax attention.
        Why: the direct path's tiled history scores such a chunk by blocks of MLX ops with an
        online softmax (MLX's exp), which cost ~1.8x native's time per 312-token chunk over
        200 tokens of SmolLM2 history (the served prompts' second chunks); the copy is no larger
        than the one tile that path unpacks."""
        store = self.store
        attention_of(store).counters.direct += 1   # the direct path's work, as the kernels'
        ctx = self._context()
        hist = ctx.history(store)
        tk, tv = store.gather_tail(self._tail_before())
        f32 = mx.float32
        k = mx.concatenate([dequantize_pages(hist.k, store.fmt.k_bits), tk.astype(f32),
                            keys.astype(f32)], axis=2)
        v = mx.concatenate([dequantize(hist.v, store.fmt.v_bits), tv.astype(f32),
                            values.astype(f32)], axis=2)
        hist_mask, new_mask = ctx.tail_masks(whole_pages=True)
        b, n = queries.shape[0], queries.shape[2]
        mask = mx.concatenate([mx.broadcast_to(m, (b, 1, n, m.shape[-1]))
                               for m in (hist_mask, new_mask)], axis=-1)
        out = cpu_softmax.prefill_attention(queries, k, v, scale, mask)
        store.flush_tail()   # this step's new tail rows, after the old tails were read
        return out.astype(queries.dtype)

    def _tail_slots(self) -> mx.array:
        """Each row's native tail slot as the step began (-1: none), once per step (a compiled
        step has it in its table: engine/runner/compiled_decode.py)."""
        slots = self.step.tail_before
        if slots is None:
            slots = self.view.masks.get("page_key_tails")
        if slots is None:
            slots = self.view.masks["page_key_tails"] = mx.array(self._tail_before())
        return slots

    def _tail_before(self) -> np.ndarray:
        """Each row's native tail slot as the step began (-1: none), from the TailMap's
        `before` when first asked (after the step's plan), then kept for the step's layers."""
        slots = self.view.masks.get("tail_before")
        if slots is None:
            slots = self.view.masks["tail_before"] = self.store.tails.tails_before(
                self.view.pages_np, self.step.starts)
        return slots

    def _page_key_prefill_attend(self, queries, keys, values, scale) -> mx.array:
        """A prefill chunk over page-key history as native prefill: the history (full pages
        from codes, the partial page from its tail as the step began) dequantized by one
        kernel into a copy, then SDPA (cuda/page_key_dequant.py)."""
        store = self.store
        attention_of(store).counters.direct += 1   # it is the direct path there
        bounds, longest = cuda_packed_prefill.step_bounds(self.step, self.view)
        out = cuda_page_key_dequant.dequant_prefill_attention(
            queries, keys, values, store.pool, store.layout, store.fmt.k_bits, store.tail,
            self.view.pages, bounds, self._tail_slots(), longest, scale,
            cuda_packed_dequant.step_mask(self.step, self.view))
        store.flush_tail()   # this step's new tail rows, after the old tails were read
        return out

    def _page_key_kernel_serves(self, queries, keys) -> bool:
        return cuda_page_key_decode.supports(self.store.fmt.k_bits, self.store.fmt.v_bits,
                                             keys.shape[-1], queries.shape[1] // keys.shape[1],
                                             self.store.page_tokens)

    def _page_key_attend(self, queries, keys, values, scale, own: bool = False) -> mx.array:
        """A decode step over page-key history through its CUDA kernel: full pages from the
        codes, each row's partial last page from the native tail slot it had as the step began
        (the store wrote this step's values already; its keys go to the tail after attention,
        as on the MLX path). `own`: the kernel stores this step's rows itself, in place (a
        compiled step: `_page_key_writes_own`)."""
        store, kernels = self.store, self.step.kernels
        out = cuda_page_key_decode.page_key_decode_attention(
            queries, keys, values, store.pool, store.layout, store.fmt.k_bits, store.tail,
            self.view.pages, self.step.ends, self._tail_slots(), self.step.longest, scale,
            kernels.decode_split_target, kernels.decode_split_min_keys,
            tail_write=self.step.slots.tail_write if own else None, mma=kernels.page_key_mma,
            wide_copies=kernels.page_key_wide_copies,
            warp_pages=kernels.page_key_warp_at(store.page_tokens),
            warp_shape=kernels.page_key_warp_shape)
        store.flush_tail()   # this step's new tail rows, after the old tails were read
        return out

    def _context(self) -> "_StepContext":
        """Index work for packed history, built once per step and shared by layers."""
        ctx = self.view.masks.get("packed")
        if ctx is None:
            ctx = _StepContext(self.step, self.view.pages)
            self.view.masks["packed"] = ctx
        return ctx


class _StepContext:
    """Index work common to every packed layer of one forward call."""

    def __init__(self, step: StepBatch, pages: mx.array):
        self.step = step
        self._sink_masks: dict[int, tuple] = {}
        t = step.page_tokens
        starts, lengths, width = step.starts, step.lengths, step.width
        self.span = int(starts.max())
        self.pages = pages[:, :-(-self.span // t)] if self.span else None
        self.hist_mask = None
        if self.span and not (starts == self.span).all():
            # Rows with shorter histories hide the tail of the gathered span.
            pos = np.arange(self.span)[None, :] < starts[:, None]
            self.hist_mask = mx.array(pos)[:, None, None, :]
        if (lengths == width).all():
            self.new_mask = "causal" if width > 1 else None
        else:
            i, j = np.arange(width)[:, None], np.arange(width)[None, :]
            m = (j <= i)[None] & (j[None] < lengths[:, None, None])
            self.new_mask = mx.array(m)[:, None]

    def sink_masks(self, rows: int) -> tuple[mx.array, mx.array]:
        """(history mask, fresh mask) when the first `rows` positions of every history page are
        read from native sink rows placed ahead of the fresh keys: history hides those positions
        (and each row's padding); a row sees a sink row only if it is in its history."""
        if rows not in self._sink_masks:
            starts, width, t = self.step.starts, self.step.width, self.step.page_tokens
            pos = np.arange(self.span)[None, :]
            hist = (pos % t >= rows) & (pos < starts[:, None])
            n_pages = self.pages.shape[1]
            sink_pos = (np.arange(n_pages)[:, None] * t + np.arange(rows)[None, :]).reshape(-1)
            sink = np.broadcast_to((sink_pos[None, :] < starts[:, None])[:, None, :],
                                   (len(starts), width, len(sink_pos)))
            fresh = self._fresh_mask(len(starts), width)
            both = np.concatenate([sink, fresh], axis=-1)
            self._sink_masks[rows] = (mx.array(hist)[:, None, None, :], mx.array(both)[:, None])
        return self._sink_masks[rows]

    def _fresh_mask(self, rows: int, width: int) -> np.ndarray:
        """[rows, width, width]: which of the step's own fresh keys each query position sees."""
        new = self.new_mask
        if new is None:
            return np.ones((rows, width, width), bool)
        if isinstance(new, str):   # causal
            return np.broadcast_to(np.tri(width, dtype=bool), (rows, width, width))
        return np.array(new)[:, 0]

    def tail_masks(self, whole_pages: bool = False) -> tuple[mx.array, mx.array]:
        """(history mask, fresh mask) when each row's partial last page is read from a native
        page placed ahead of the fresh keys: history shows full pages only; a row sees the
        first `start % page_tokens` native rows (its tail) and its fresh keys as before.
        `whole_pages`: the history spans every gathered page (page keys), not just `span`."""
        key = ("tail", whole_pages)
        if key not in self._sink_masks:
            starts, width, t = self.step.starts, self.step.width, self.step.page_tokens
            full = starts // t * t
            n = self.pages.shape[1] * t if whole_pages else self.span
            hist = np.arange(n)[None, :] < full[:, None]
            tail = np.arange(t)[None, :] < (starts - full)[:, None]
            tail = np.broadcast_to(tail[:, None, :], (len(starts), width, t))
            fresh = self._fresh_mask(len(starts), width)
            both = np.concatenate([tail, fresh], axis=-1)
            self._sink_masks[key] = (mx.array(hist)[:, None, None, :], mx.array(both)[:, None])
        return self._sink_masks[key]

    def history(self, store):
        if not self.span:
            return None
        hist = store.gather_packed(self.pages)
        if store.whole_pages:   # page keys: metadata per page, never cut
            return hist
        return type(hist)(*(type(p)(*(a[..., :self.span, :] for a in p)) for p in hist))
