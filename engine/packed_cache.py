"""Adapter that lets unmodified mlx-lm model code attend over packed pages.

mlx-lm layers call `cache.update_and_fetch(k, v)` and then the `scaled_dot_product_attention`
their module imported from mlx_lm.models.base. For a packed layer we must (1) write the new rows
quantized, (2) hand attention the fresh rows in full precision, and (3) read earlier history
packed. `PackedLayerCache` does (1) and (2) and exposes `attend`; `install_attention_hook`
wraps each model module's SDPA symbol so a cache with `attend` is asked to attend, and every
other cache takes mlx-lm's original path unchanged.

`PackedModelRunner` is ModelRunner with one change: packed layer stores get a PackedLayerCache.
It exists only until the runner asks its stores for their cache class (see the issue-3 report).
"""
from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from engine.attention import PagedLayerCache, Row, StepBatch
from engine.runner import ModelRunner

_HOOK_MARK = "_orchard_packed_hook"


class PackedLayerCache(PagedLayerCache):
    """One packed full-attention layer over one forward call."""

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        b, h, n, d = keys.shape
        k = keys.transpose(0, 2, 1, 3).reshape(b * n, h, d)
        v = values.transpose(0, 2, 1, 3).reshape(b * n, h, values.shape[-1])
        if self.step.valid is not None:
            k, v = k[self.step.valid], v[self.step.valid]
        self.store.write(self.step.slots, k, v)
        # The step's own rows go to attention unquantized; history is read packed in attend().
        return keys, values

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        hist, hist_mask, new_mask = self._context()
        return self.store.attention(queries, hist, keys, values, scale=scale, new_mask=new_mask,
                                    hist_mask=hist_mask, sinks=sinks)

    def _context(self):
        """(packed history, its mask, fresh-row mask), built once per step and shared by layers."""
        ctx = self.view.masks.get("packed")
        if ctx is None:
            ctx = _StepContext(self.step, self.view.pages)
            self.view.masks["packed"] = ctx
        return ctx.history(self.store), ctx.hist_mask, ctx.new_mask


class _StepContext:
    """Index work common to every packed layer of one forward call."""

    def __init__(self, step: StepBatch, pages: mx.array):
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

    def history(self, store):
        if not self.span:
            return None
        hist = store.gather_packed(self.pages)
        return type(hist)(*(type(p)(*(a[..., :self.span, :] for a in p)) for p in hist))


def install_attention_hook(model) -> None:
    """Route SDPA calls with an `attend`-capable cache to it, in every module the model uses."""
    for _, module in model.named_modules():
        mod = sys.modules.get(type(module).__module__)
        original = getattr(mod, "scaled_dot_product_attention", None)
        if original is None or getattr(original, _HOOK_MARK, False):
            continue

        def hooked(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None,
                   _original=original):
            attend = getattr(cache, "attend", None)
            if attend is not None:
                return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
            return _original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                             sinks=sinks)

        setattr(hooked, _HOOK_MARK, True)
        mod.scaled_dot_product_attention = hooked


class PackedModelRunner(ModelRunner):
    """ModelRunner whose packed layer stores attend through PackedLayerCache."""

    def __init__(self, loaded, kvstore, merge_pad_tokens: int = 32):
        super().__init__(loaded, kvstore, merge_pad_tokens)
        install_attention_hook(loaded.model)

    def _run(self, chunks, last_only: bool) -> mx.array:
        rows = [Row(c.start, len(c.token_ids), c.page_table) for c in chunks]
        step = StepBatch(rows, self.page_tokens)
        tokens = np.zeros((len(rows), step.width), dtype=np.int32)
        for i, c in enumerate(chunks):
            tokens[i, :len(c.token_ids)] = c.token_ids
        caches = []
        for i, w in enumerate(self._windows):
            store = self.kvstore.layer(i)
            cls = PackedLayerCache if getattr(store, "packed", False) else PagedLayerCache
            caches.append(cls(store, step, w))
        inputs = mx.array(tokens)
        loaded = self.loaded
        if not last_only:
            return loaded.model(inputs, cache=caches)
        last = mx.array((step.lengths - 1).astype(np.int32))
        if loaded.body is not None:
            hidden = loaded.body(inputs, caches)
            return loaded.head(hidden[mx.arange(len(rows)), last])
        return loaded.model(inputs, cache=caches)[mx.arange(len(rows)), last]
