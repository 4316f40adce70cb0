"""Projections of a few rows (decode steps) on the CPU by one Numba kernel that streams each
weight once, split over both cores.

Why (issue 30): a CPU decode step of SmolLM2 is mostly its projections, and with 8-32 rows
those are bound by reading the float32 weights (~430 MB a step) from memory. OpenBLAS, behind
MLX's matmul, packs and blocks for large products: with 16 rows it read the layers' weights at
6-8 GB/s where the box streams 12.8 GB/s on one core, and with 8 rows its time hardly fell
(the 8 rows of a schedule's tail cost as much per step as 16). Here each weight row is read once
and multiplied with every input row while it is in cache: 4 weight rows x 2 input rows of
running sums per pass over the inner dimension (8 FMA for 6 loads, vectorised by LLVM along
it), the output columns cut in two halves, one on the parked worker (engine/cpu_worker.py).
Measured over 30 layers' distinct weights (cold, as a step reads them): 0.45x MLX's time at 8
rows, 0.70-0.78x at 16, 0.8x at 32. A call also pays ~60-100 us around the kernel (evaluating
its input, the copies in and out of MLX, the hand-off), ~10 ms over a SmolLM2 step's 121
projections, so whole decode steps gain less (bench.cpu_profile,
docs/lab/benchmarks-cpu-engine.md): 0.78x at 8 rows, 0.96x at 16, 1.01x at 32 (0.96x the CPU
time). Calls of more than MAX_ROWS rows (larger decode batches, prefill chunks) keep MLX's
matmul.

How: `install_linear_hook` changes the class of the model's float32 linear layers (including
the fused q/k/v and gate/up layers of engine/model/fuse.py, and the pre-transposed ones of
engine/model/linear.py) to `SkinnyLinear`, and of its embeddings to `SkinnyEmbedding` (a tied
LM head), subclasses with the same parameters and names, as linear.py's own swaps do. Their
calls take the kernel only inside `skinny_linears()` on this thread (the runner's CPU steps),
for float32 inputs of at most MAX_ROWS rows; everywhere else (another thread, mlx-lm itself, a
compiled trace) they are the layer's own call. Each output is the same float32 dot product as
MLX's, summed in another order (results equal up to rounding, not bit for bit).
"""
from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.cpu_worker import nogil_kernel, parked_worker
from engine.model.linear import PretransposedEmbedding, PretransposedLinear
from engine.thread_switch import ThreadSwitch

# The most rows (tokens) a call may have to take the kernel: a 32-row decode step took as long
# either way (1.01x) with 0.96x the CPU time; beyond it OpenBLAS's blocking wins.
MAX_ROWS = 32
_SWITCH = ThreadSwitch()


def _skinny(x, w, y, n_lo, n_hi):  # pragma: no cover - compiled
    """y[:, n_lo:n_hi] = x @ w[n_lo:n_hi].T for x [M, K] (M even), w [N, K] (n_lo, n_hi
    multiples of 4 or n_hi = N)."""
    rows, inner = x.shape
    n = n_lo
    while n + 4 <= n_hi:
        w0, w1, w2, w3 = w[n], w[n + 1], w[n + 2], w[n + 3]
        for m in range(0, rows, 2):
            xa, xb = x[m], x[m + 1]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            for k in range(inner):
                u, v = xa[k], xb[k]
                c0, c1, c2, c3 = w0[k], w1[k], w2[k], w3[k]
                a0 += u * c0
                a1 += u * c1
                a2 += u * c2
                a3 += u * c3
                b0 += v * c0
                b1 += v * c1
                b2 += v * c2
                b3 += v * c3
            y[m, n], y[m, n + 1], y[m, n + 2], y[m, n + 3] = a0, a1, a2, a3
            y[m + 1, n], y[m + 1, n + 1], y[m + 1, n + 2], y[m + 1, n + 3] = b0, b1, b2, b3
        n += 4
    while n < n_hi:   # the last N % 4 columns
        w0 = w[n]
        for m in range(rows):
            xa = x[m]
            a0 = np.float32(0.0)
            for k in range(inner):
                a0 += xa[k] * w0[k]
            y[m, n] = a0
        n += 1


@functools.cache
def _kernel():
    return nogil_kernel(_skinny, "CPU projection kernel")


def skinny_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [M, K] @ w [N, K].T (float32, contiguous), the columns split over two threads. Each
    row's result is the same whatever rows come with it (an odd count is padded with a copy of
    its last row, so every row goes through the same paired loop): a merged step's rows equal
    their per-group calls'."""
    rows, n = x.shape[0], w.shape[0]
    if rows % 2:
        x = np.concatenate([x, x[-1:]])
    y = np.empty((x.shape[0], n), np.float32)
    kernel = _kernel()
    half = (n // 2) // 4 * 4
    if half >= 4:
        rest = parked_worker().submit(kernel, x, w, y, half, n)
        kernel(x, w, y, 0, half)
        rest.result()
    else:
        kernel(x, w, y, 0, n)
    return y[:rows]


def _by_kernel(x: mx.array, weight: mx.array) -> np.ndarray | None:
    """x @ weight.T by the kernel where this call qualifies (inside `skinny_linears()`, float32,
    at most MAX_ROWS rows, a row-major [out, in] weight), else None."""
    if not _SWITCH.on or x.dtype != mx.float32 or weight.dtype != mx.float32:
        return None
    rows = x.size // x.shape[-1]
    w = np.asarray(weight)             # a view of MLX's buffer
    if rows > MAX_ROWS or not w.flags.c_contiguous:
        return None
    mx.eval(x)
    return skinny_matmul(np.ascontiguousarray(np.asarray(x).reshape(rows, x.shape[-1])), w)


def _shaped(y: np.ndarray, x: mx.array) -> mx.array:
    return mx.array(y).reshape(*x.shape[:-1], y.shape[-1])


class SkinnyLinear(PretransposedLinear):
    """A linear layer whose calls of few float32 rows inside `skinny_linears()` take the kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _by_kernel(x, self["weight"])
        if y is None:
            return super().__call__(x)
        if "bias" in self:
            y += np.asarray(self["bias"])
        return _shaped(y, x)


class SkinnyEmbedding(PretransposedEmbedding):
    """The same for tied embeddings used as the LM head (`as_linear`)."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _by_kernel(x, self["weight"])
        return super().as_linear(x) if y is None else _shaped(y, x)


_SWAP = {nn.Linear: SkinnyLinear, PretransposedLinear: SkinnyLinear,
         nn.Embedding: SkinnyEmbedding, PretransposedEmbedding: SkinnyEmbedding}


def install_linear_hook(model: nn.Module) -> int:
    """Make every float32 linear layer and embedding of `model` (plain or pre-transposed, not
    quantized or other subclasses) its Skinny twin (same parameters, same call outside the
    context); returns how many it changed (idempotent)."""
    count = 0
    for _, module in model.named_modules():
        cls = _SWAP.get(type(module))
        if cls is not None and module["weight"].dtype == mx.float32:
            module.__class__ = cls
            count += 1
    return count


def skinny_linears(on: bool = True):
    """While inside (and `on`), hooked projections of few rows on this thread take the kernel."""
    return _SWITCH.set(on)
