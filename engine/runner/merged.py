"""A mixed step (rows of different lengths: a prompt's chunk and the decode rows) as one model
call whose projections see every group's tokens at once (engine/model/flat_step.py).

The runner still groups rows by length (ModelRunner._groups) so attention keeps its padded
[rows, width] calls; only the weights are streamed once instead of once per group. Logits are
the same as the per-group calls' up to float rounding (the GEMMs see more rows), which
tests/engine/runner/test_merged_steps.py checks.

Packed layers (engine/attention/packed_cache.py) plan per call: a native-tail format's shared
TailMap is planned by a call's first write, its page-key fills from the map as that call began,
and each layer writes its new tail rows after its own attention. Here every layer writes all
groups before any attends, so each group's caches make those plans up front, group by group in
the order the per-group calls would (`PackedLayerCache.plan_ahead`), and hold their tail rows
until their own attention: the pool and tails end byte for byte as the per-group calls leave
them (tests/engine/runner/test_merged_packed.py).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.attention.packed_cache import PackedLayerCache
from engine.attention.paged import PagedLayerCache
from engine.model.cpu_linear import skinny_linears
from engine.model.cpu_swiglu import numpy_swiglu
from engine.model.flat_step import RowGroup, flat_step_body
from engine.runner.tokens import input_tokens
from engine.sched.seq import Chunk


class MergedSteps:
    """Runs a runner's multi-group steps in one call; `for_runner` builds it where it fits."""

    def __init__(self, runner, body):
        self.runner = runner
        self.body = body

    @classmethod
    def for_runner(cls, runner) -> "MergedSteps | None":
        """The merged path for `runner`, or None where it does not fit: KernelChoices.merged_steps
        off; a CUDA decode kernel in use (it writes a decode row's keys inside attention, after
        the other groups' reads, which would copy the page arrays); compiled decode steps (they
        take a mixed step's decode rows: one traced call, where steps are host-bound); recurrent
        layers (per-sequence state merged per call); a layer that `_layer_merges` refuses; a
        model other than a plain Llama."""
        if (not runner.kernels.merged_steps or runner.kernel_decode or runner.recurrent
                or runner.compiled is not None):
            return None
        if runner.loaded.body is None or not all(map(_layer_merges, runner.layer_caches)):
            return None
        body = flat_step_body(runner.loaded.model)
        return None if body is None else cls(runner, body)

    def forward(self, chunks: list[Chunk], groups: list[list[int]]) -> mx.array:
        """Float32 logits [len(chunks), vocab] of each chunk's last token, in chunk order."""
        runner = self.runner
        runner.model_calls += 1
        row_groups, picks, order, start = [], [], [], 0
        for group in groups:
            rows = [chunks[i] for i in group]
            step = runner.step_batch(rows)
            caches = runner.step_caches(step, {})
            for cache in caches:   # packed layers' per-call plans, group by group (module doc)
                if isinstance(cache, PackedLayerCache):
                    cache.plan_ahead()
            row_groups.append(RowGroup(input_tokens(rows, step.width), caches))
            # Each row's last real token, in the flattened [rows * width] positions.
            picks.extend(start + j * step.width + int(n) - 1 for j, n in enumerate(step.lengths))
            start += step.size * step.width
            order.extend(group)
        with numpy_swiglu(runner.cpu_swiglu), skinny_linears(runner.cpu_linear):
            logits = runner.loaded.head(self.body(row_groups, mx.array(picks, dtype=mx.int32)))
        back = mx.array(np.argsort(np.array(order)).astype(np.int32))
        return logits[back].astype(mx.float32)


def _layer_merges(layer_cache) -> bool:
    """Whether a layer's cache (ModelRunner.layer_caches: class, store, window) serves a merged
    step: native pages; packed ones on the CPU (their plans made ahead: the module doc) without
    native sink rows (int4-sink keeps per-page native rows this path has not been checked with).
    On CUDA packed layers keep their per-group calls: their prefill and page-key kernels read
    and flush per call, and were not checked against this order (nor is a page-key store whose
    writes take the CUDA kernel: its new tails replace the old whole, not row by row)."""
    if layer_cache is None:
        return False
    cls, store, _ = layer_cache
    if cls is PagedLayerCache:
        return True
    return (cls is PackedLayerCache and mx.default_device() == mx.cpu
            and not store.sink_rows and store.chunk_writer is None)
