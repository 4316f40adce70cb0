"""Paged attention behind mlx-lm's own cache protocol, so unmodified model code runs on pages.

mlx-lm attention does `q = rope(q, offset=cache.offset)`, `k, v = cache.update_and_fetch(k, v)`,
then `scaled_dot_product_attention(q, k, v, cache=cache, mask=mask, sinks=...)`, and the model
builds masks once per forward with `cache.make_mask(...)` on one full and one sliding layer.
`PagedLayerCache` answers those calls. Two modes:

- gather: `update_and_fetch` writes the new K/V by slot and returns the rows' pages gathered
  into a padded batch; the mask hides padding, future keys and (sliding layers) keys older than
  the window. Works with any model code; costs one copy of the context per layer and step.
- direct: `install_sdpa_hook` routes mlx-lm's `scaled_dot_product_attention` to `cache.attend`
  when the cache has one, so attention can read pages without that copy (see
  `paged_decode_attention`); packed stores name their own cache class whose `attend` reads
  packed pages. The runner verifies at start that every paged layer calls the hook; otherwise
  it stays in gather mode. On CUDA, steps whose rows all decode one token attend through one
  kernel per layer that reads the pages by page table (`engine/attention/cuda/paged_decode.py`); the
  runner decides per step (`StepBatch.kernel_decode`) and no mask is built then.

Rows are right-padded to the longest chunk of the forward call. Indices (slots, page lists,
masks) are built once per call in `StepBatch` and shared by every layer. Attention sinks
(gpt_oss) follow `mx.fast.scaled_dot_product_attention`: one extra logit per head in the softmax.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.attention import cpu_decode, cpu_prefill, cpu_softmax, ops_prefill
from engine.attention.choices import DEFAULT_KERNELS
from engine.attention.cuda import native_tiled_decode
from engine.attention.cuda import paged_decode as cuda_paged_decode
from engine.kv.store import LayerStore, Slots


@dataclass
class View:
    """The keys a group of layers sees: which pages each row reads, and from which position."""

    window: int | None
    pages_np: np.ndarray            # [B, P] physical page ids (padding repeats a live page)
    pages: mx.array
    base: np.ndarray                # [B] position of the first key of each row's first page
    key_slice: tuple[int, int] | None = None   # one-row calls: exact key range (mlx-lm's view)
    masks: dict = field(default_factory=dict)  # masks and gather_mm indices, built on demand


class StepBatch:
    """Per-forward indices shared by all layers: slots to write, pages to read, masks."""

    # Each row's native tail slot as the step began, where a compiled step carries it
    # (engine/runner/compiled_decode.DeviceDecodeStep); here page-key attention derives it.
    tail_before = None

    def __init__(self, rows: list, page_tokens: int, width_bucket: int | None = None):
        """`rows`: the call's rows (engine.sched.seq.Chunk, the one row shape from the scheduler);
        read here: `start` (tokens already in KV), `length` (new tokens), `page_table` (covers
        start + length tokens).

        `width_bucket` (EngineConfig.prefill_width_bucket): a multi-token call's width is
        rounded up to a multiple of it and its keys span whole pages, so calls of different
        lengths share a few (queries, keys) shapes (a backend that plans or compiles per shape
        pays that once per bucket, not once per prompt length). The extra positions are padding
        like any short row's: `valid` drops their K/V and `_mask` hides keys past each row's
        last real token. Decode calls (width 1) are never bucketed."""
        self.rows = rows
        self.page_tokens = page_tokens
        self.size = len(rows)
        longest = max(r.length for r in rows)
        self.bucketed = width_bucket is not None and longest > 1
        self.width = -(-longest // width_bucket) * width_bucket if self.bucketed else longest
        self.starts = np.array([r.start for r in rows], dtype=np.int64)
        self.lengths = np.array([r.length for r in rows], dtype=np.int64)
        # RoPE positions: an int for one row (as mlx-lm does), per-row offsets for a batch.
        self.offset = (int(self.starts[0]) if self.size == 1
                       else mx.array(self.starts.astype(np.int32)))
        if self.width == 1:
            # Decode rows: one slot each, read straight off the page tables (no per-row arrays).
            t = page_tokens
            self.slots = Slots([r.page_table[r.start // t] for r in rows], self.starts % t)
            self.valid = None
        else:
            self.slots = Slots.from_flat(self._slot_ids(), page_tokens)
            # Padded positions produce K/V too; keep only real tokens when any row is padded.
            real = np.arange(self.width)[None, :] < self.lengths[:, None]
            self.valid = (None if real.all()
                          else mx.array(np.flatnonzero(real).astype(np.int32)))
        self.attended = 0  # layers that reached `attend` (the runner's routing check)
        self._views: dict[int | None, View] = {}
        # Set by the runner: every row decodes one token and full-attention layers attend
        # through the CUDA paged-decode kernel (engine/attention/cuda/paged_decode.py) instead
        # of gather.
        self.kernel_decode = False
        self.kernels = DEFAULT_KERNELS   # the runner's KernelChoices (split targets, tiles)
        # Set by the runner: attention's softmax runs in NumPy (engine/attention/cpu_softmax.py;
        # CPU backend, float32 pages, KernelChoices.cpu_softmax).
        self.cpu_softmax = False
        # Set by the runner: one-token rows attend through the Numba kernel over float32 pages
        # (engine/attention/cpu_decode.py; CPU backend, KernelChoices.cpu_decode), page-key
        # layers' through engine/attention/cpu_page_key_decode.py.
        self.cpu_decode = False
        # Set by the runner: multi-token rows likewise through engine/attention/cpu_prefill.py
        # (KernelChoices.cpu_prefill).
        self.cpu_prefill = False
        # Set by the runner on the CPU: RoPE by a per-position table (engine/model/rope_table.py)
        # instead of MLX's per-element sine and cosine; `rotation` gathers this step's angles.
        self.rope_table = None
        self._rotation = None
        # Set by the runner: multi-token calls attend through MLX ops (ops_prefill.py) where
        # their scores fit, instead of mx.fast's SDPA (KernelChoices.prefill_attention).
        self.prefill_ops = False
        self._ends: mx.array | None = None
        self.longest = int((self.starts + self.lengths).max())   # keys of the longest row

    @property
    def ends(self) -> mx.array:
        """Keys each row attends to after this call (int32 [B]), built once per step."""
        if self._ends is None:
            self._ends = mx.array((self.starts + self.lengths).astype(np.int32))
        return self._ends

    def _slot_ids(self) -> np.ndarray:
        t = self.page_tokens
        out = []
        for r in self.rows:
            pos = np.arange(r.start, r.start + r.length)
            out.append(np.asarray(r.page_table, dtype=np.int64)[pos // t] * t + pos % t)
        return np.concatenate(out)

    def rotation(self):
        """This step's RoPE angles from the runner's table (one gather for every layer), or
        None where the layers' own rope modules rotate."""
        if self.rope_table is None:
            return None
        if self._rotation is None:
            positions = self.starts[:, None] + np.arange(self.width)[None, :]
            self._rotation = self.rope_table.rotation(positions)
        return self._rotation

    def view(self, window: int | None) -> View:
        if window not in self._views:
            self._views[window] = self._build_view(window)
        return self._views[window]

    def _build_view(self, window: int | None) -> View:
        t = self.page_tokens
        ends = self.starts + self.lengths
        first = (np.zeros(self.size, dtype=np.int64) if window is None
                 else np.maximum(self.starts - window + 1, 0) // t)
        last = (ends - 1) // t + 1
        pages = np.empty((self.size, int((last - first).max())), dtype=np.int32)
        for i, r in enumerate(self.rows):
            row = r.page_table[first[i]:last[i]]
            pages[i, :len(row)] = row
            pages[i, len(row):] = row[0]  # any live page; the mask hides it
        base = first * t
        key_slice = None
        # Bucketed calls keep whole pages: an exact range would give every prompt length its own
        # key count, and the width's padded queries rule out mlx-lm's "causal" string mask.
        if self.size == 1 and not self.bucketed:
            lo = 0
            if window is not None and self.lengths[0] == 1:
                lo = max(int(ends[0]) - window, 0) - int(base[0])
            key_slice = (lo, int(ends[0] - base[0]))
        return View(window, pages, mx.array(pages), base, key_slice)

    def sdpa_mask(self, view: View):
        """Mask for gathered keys (sliced to `key_slice` in one-row calls)."""
        if "sdpa" not in view.masks:
            if view.key_slice is not None and (view.window is None or self.lengths[0] == 1):
                # One row, exact key range: the same mask mlx-lm's own caches produce.
                view.masks["sdpa"] = None if self.lengths[0] == 1 else "causal"
            else:
                view.masks["sdpa"] = self._mask(view, view.key_slice)
        return view.masks["sdpa"]

    def page_mask(self, view: View) -> mx.array:
        """Mask over every key of the view's whole pages (paths that read pages in place)."""
        if "page" not in view.masks:
            view.masks["page"] = self._mask(view, None)
        return view.masks["page"]

    def _mask(self, view: View, key_slice: tuple[int, int] | None) -> mx.array:
        lo, hi = key_slice or (0, view.pages_np.shape[1] * self.page_tokens)
        key_pos = view.base[:, None] + np.arange(lo, hi)[None, :]
        # Padded queries reuse their row's last real position so no query row is fully masked.
        q_pos = self.starts[:, None] + np.minimum(np.arange(self.width)[None, :],
                                                  self.lengths[:, None] - 1)
        q = mx.array(q_pos.astype(np.int32))[:, None, :, None]
        k = mx.array(key_pos.astype(np.int32))[:, None, None, :]
        mask = k <= q
        if view.window is not None:
            mask = mask & (k > q - view.window)
        return mask

    def gather_mm_indices(self, view: View, kv_heads: int, num_pages: int):
        """Flat batch indices for `mx.gather_mm`: (row, head) query blocks x (head, page)."""
        key = ("gmm", kv_heads, num_pages)
        if key not in view.masks:
            b, p = view.pages_np.shape
            heads = np.arange(kv_heads)[None, :, None]
            lhs = np.broadcast_to(np.arange(b)[:, None, None] * kv_heads + heads, (b, kv_heads, p))
            rhs = heads * num_pages + view.pages_np[:, None, :]
            view.masks[key] = (mx.array(lhs.astype(np.int32)), mx.array(rhs.astype(np.int32)))
        return view.masks[key]


# Masked scores: the dtype's lowest finite value, as mlx-lm does (exp underflows to exactly 0).
_LOWEST = {t: mx.finfo(t).min for t in (mx.float32, mx.float16, mx.bfloat16)}


def paged_decode_attention(q: mx.array, k_pages: mx.array, v_pages: mx.array, step: StepBatch,
                           view: View, scale: float, sinks: mx.array | None) -> mx.array:
    """Attention straight from head-major pages [kv_heads, num_pages, T, dim] via gather_mm.

    Scores are computed page by page against the live pages, so the context is read once
    instead of gathered into a copy first; on the CPU this is faster than gather + SDPA for
    decode (docs/lab/engine-kernel-notes.md). The PV product leaves one partial output per
    page, so it only pays for short query blocks (group * tokens <= page size); prefill uses
    gather + SDPA.
    """
    b, hq, n, d = q.shape
    kv_heads, num_pages, t, _ = k_pages.shape
    group, p = hq // kv_heads, view.pages_np.shape[1]
    lhs, rhs = step.gather_mm_indices(view, kv_heads, num_pages)
    qg = (q * scale).reshape(b * kv_heads, group * n, d)
    s = mx.gather_mm(qg, k_pages.swapaxes(-1, -2), lhs, rhs)          # [b, kvh, p, g*n, t]
    s = s.transpose(0, 1, 3, 2, 4).reshape(b, kv_heads, group, n, p * t)
    mask = step.page_mask(view)[:, :, None]                            # [b, 1, 1, n, p*t]
    s = mx.where(mask, s, _LOWEST[s.dtype])
    # Both score arrays below are fresh results only this function holds, as
    # cpu_softmax.softmax_in_place requires.
    softmax = (cpu_softmax.softmax_in_place if step.cpu_softmax
               else lambda x: mx.softmax(x, axis=-1, precise=True))
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(s.dtype).reshape(1, kv_heads, group, 1, 1),
                               (b, kv_heads, group, n, 1))
        probs = softmax(mx.concatenate([sink, s], axis=-1))[..., 1:]
    else:
        probs = softmax(s)
    probs = probs.reshape(b, kv_heads, group * n, p, t).transpose(0, 1, 3, 2, 4)
    out = mx.gather_mm(probs, v_pages, None, rhs)                     # [b, kvh, p, g*n, dv]
    return out.sum(axis=2).reshape(b, hq, n, v_pages.shape[-1])


class PagedLayerCache:
    """mlx-lm cache protocol for one layer during one forward call."""

    def __init__(self, store: LayerStore, step: StepBatch, window: int | None,
                 direct: bool = False, in_place_decode: bool = False):
        self.store = store
        self.step = step
        self.view = step.view(window)
        self.offset = step.offset
        self.direct = direct
        self.in_place_decode = in_place_decode
        self._own: tuple[mx.array, mx.array] | None = None   # written by the decode kernel

    def rotate(self, rope, x: mx.array) -> mx.array:
        """`rope(x, offset=self.offset)`, by the step's angle table where it has one."""
        rotation = self.step.rotation()
        return rope(x, offset=self.offset) if rotation is None else rotation.apply(x)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, n, d = keys.shape
        if n == 1 and self._decode_writes_own():
            # The CUDA decode kernel writes them (attend): no scatter in this step's graph.
            self._own = (keys, values)
            return keys, values
        if n == 1:   # one token per row, written as it comes
            if self.direct and self._kernel_decode():
                # A write kernel and the attention kernel both read these rows, and each CUDA
                # kernel copies a strided input to a row-contiguous one first: at batch > 1
                # values are a slice of the fused q/k/v projection (engine/model/fuse.py). One
                # copy, shared by both (a no-op where the rows are contiguous already).
                keys, values = mx.contiguous(keys), mx.contiguous(values)
            self.store.write_decode(self.step.slots, keys, values)
        else:
            self._write(keys, values)
        if self.direct:
            return keys, values  # attend() reads the pages; these are only passed back to it
        return self.gathered()

    def _write(self, keys: mx.array, values: mx.array) -> None:
        b, h, n, d = keys.shape
        if n == 1:   # one token per row: [B, h, 1, d] is already token-major
            k, v = keys.reshape(b, h, d), values.reshape(b, h, values.shape[-1])
        else:
            k = keys.transpose(0, 2, 1, 3).reshape(b * n, h, d)
            v = values.transpose(0, 2, 1, 3).reshape(b * n, h, values.shape[-1])
        if self.step.valid is not None:
            k, v = k[self.step.valid], v[self.step.valid]
        self.store.write(self.step.slots, k, v)

    def _kernel_decode(self) -> bool:
        return self.step.kernel_decode and self.view.window is None

    def _decode_writes_own(self) -> bool:
        """Whether this decode step's own keys go to the pages through the CUDA decode kernel
        (cuda/paged_decode.py, `own`): direct mode (attend gets the fresh rows), the kernel
        path, a store whose pages the kernel reads as they are (`decode_writes_own`)."""
        return (self.direct and self._kernel_decode() and self.step.kernels.decode_writes_own
                and self.store.decode_writes_own)

    @staticmethod
    def kernel_decode_fits(store: LayerStore, kernels=DEFAULT_KERNELS) -> bool:
        """Whether decode steps of a layer read through this cache class may attend through a
        CUDA decode kernel (the runner asks for classes other than this one; it also requires
        CUDA and one query token per row). Subclasses that attend otherwise say no."""
        return False

    def gathered(self) -> tuple[mx.array, mx.array]:
        k, v = self.store.gather(self.view.pages)
        if self.view.key_slice is not None:
            lo, hi = self.view.key_slice
            k, v = k[:, :, lo:hi], v[:, :, lo:hi]
        return k, v

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if self._kernel_decode():
            return None   # the kernel bounds each row by its own length
        if return_array:
            return self.step.page_mask(self.view) if self.direct else \
                self.step._mask(self.view, self.view.key_slice)
        return self.step.sdpa_mask(self.view)

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None) -> mx.array:
        """Attention over this layer's pages (the hook calls it). Reads the pages, so it is
        right in either mode; in direct mode `keys`/`values` are the call's fresh rows."""
        self.step.attended += 1
        own, self._own = self._own, None
        if sinks is None and self._kernel_decode():
            k_pages, v_pages = self.store.head_major_pages()
            if self.step.kernels.native_decode == "tiled" and native_tiled_decode.supports(
                    queries.shape[3], queries.shape[1] // k_pages.shape[0], k_pages.dtype):
                return native_tiled_decode.tiled_decode_attention(
                    queries, k_pages, v_pages, self.view.pages, self.step.ends, scale,
                    self.step.longest, self.step.kernels.decode_split_target,
                    self.step.kernels.decode_split_min_keys, own=own)
            return cuda_paged_decode.paged_decode_attention(
                queries, k_pages, v_pages, self.view.pages, self.step.ends, scale,
                self.step.longest, self.step.kernels.decode_split_target,
                self.step.kernels.decode_split_min_keys, own=own)
        if own is not None:   # sinks: the kernel does not serve this call, so write them now
            self.store.write_decode(self.step.slots, *own)
        pages = self.store.head_major_pages()
        if self.step.cpu_decode and sinks is None and queries.shape[2] == 1 and pages is not None:
            lo, hi = cpu_decode.row_bounds(self.view.base, self.step.starts, self.step.lengths,
                                           self.view.window)
            return cpu_decode.decode_attention(queries, *pages, self.view.pages_np, lo, hi, scale)
        if self.step.cpu_prefill and sinks is None and queries.shape[2] > 1 and pages is not None:
            return cpu_prefill.prefill_attention(
                queries, *pages, self.view.pages_np, self.step.starts, self.view.base,
                self.step.lengths, self.view.window, scale)
        group = queries.shape[1] // keys.shape[1]
        # Page-wise PV partials (group*n rows per page) stay no larger than a gathered V copy.
        if (self.in_place_decode and pages is not None
                and group * queries.shape[2] <= self.step.page_tokens):
            k_pages, v_pages = pages
            return paged_decode_attention(queries, k_pages, v_pages, self.step, self.view,
                                          scale, sinks)
        k, v = self.gathered()
        if self.step.cpu_softmax and sinks is None and queries.shape[2] > 1:
            return cpu_softmax.prefill_attention(queries, k, v, scale,
                                                 self.step.sdpa_mask(self.view))
        if self.step.prefill_ops and sinks is None and ops_prefill.use_ops(queries, k):
            return ops_prefill.ops_attention(queries, k, v, scale, self.step.sdpa_mask(self.view))
        return mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask=self.step.sdpa_mask(self.view), sinks=sinks)


def _paged_sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    attend = getattr(cache, "attend", None)
    if attend is not None:
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _original_sdpa():
    from mlx_lm.models import base
    return base.scaled_dot_product_attention


_ORIGINAL_SDPA = _original_sdpa()


def install_sdpa_hook(model) -> None:
    """Point every model module's `scaled_dot_product_attention` at the paged dispatcher.

    Idempotent. A cache with an `attend` method is asked to attend (paged and packed caches);
    every other cache falls through to mlx-lm's own function unchanged, so other users of the
    same modules are unaffected.
    """
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA:
            module.scaled_dot_product_attention = _paged_sdpa
