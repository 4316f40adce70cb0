"""A mixed step (rows of different lengths: a prompt's chunk and the decode rows) as one model
call whose projections see every group's tokens at once (engine/model/flat_step.py).

The runner still groups rows by length (ModelRunner._groups) so attention keeps its padded
[rows, width] calls; only the weights are streamed once instead of once per group. Logits are
the same as the per-group calls' up to float rounding (the GEMMs see more rows), which
tests/engine/runner/test_merged_steps.py checks.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.attention.paged import PagedLayerCache
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
        take a mixed step's decode rows: one traced call, where steps are host-bound); packed or
        recurrent layers (their caches keep per-call state: tails, sinks); a model other than a
        plain Llama."""
        if (not runner.kernels.merged_steps or runner.kernel_decode or runner.recurrent
                or runner.compiled is not None):
            return None
        if runner.loaded.body is None or any(
                lc is None or lc[0] is not PagedLayerCache for lc in runner.layer_caches):
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
            row_groups.append(RowGroup(input_tokens(rows, step.width),
                                       runner.step_caches(step, {})))
            # Each row's last real token, in the flattened [rows * width] positions.
            picks.extend(start + j * step.width + int(n) - 1 for j, n in enumerate(step.lengths))
            start += step.size * step.width
            order.extend(group)
        with numpy_swiglu(runner.cpu_swiglu):
            logits = runner.loaded.head(self.body(row_groups, mx.array(picks, dtype=mx.int32)))
        back = mx.array(np.argsort(np.array(order)).astype(np.int32))
        return logits[back].astype(mx.float32)
