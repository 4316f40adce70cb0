"""mlx-lm's SwiGLU (silu(gate) * x) computed by NumPy during the engine's CPU steps.

MLX's CPU backend has no vector math on x86: its sigmoid runs one element at a time through a
polynomial whose fused multiply-adds are libm calls, far slower than NumPy's exp. In a CPU
prefill that made the MLP's activation a large share of the time once attention's softmax had
moved to NumPy (bench/cpu_profile.py; the numbers: docs/lab/engine-kernel-notes.md). The
projections around it stay MLX GEMMs.

How, without forking mlx-lm's model files: `install_swiglu_hook` points every model module's
`swiglu` at `_swiglu`, as engine/attention/paged.py does for attention. The hook computes in
NumPy only inside `numpy_swiglu()` on this thread (the runner's model calls on the CPU) and only
for float32 inputs; every other caller (mlx-lm itself, other threads, a compiled trace, which
cannot evaluate mid-graph) gets mlx-lm's function unchanged.
"""
from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import activations

from engine.cpu_worker import parked_worker
from engine.thread_switch import ThreadSwitch

_ORIGINAL = activations.swiglu
_SWITCH = ThreadSwitch()


def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    if _SWITCH.on and gate.dtype == mx.float32 and x.dtype == mx.float32:
        return numpy_silu_mul(gate, x)
    return _ORIGINAL(gate, x)


# From this many elements a call is cut in two along its rows, one half on the parked worker
# (engine/cpu_worker.py): a prefill chunk's [512, 1536] took 2.05 ms on one core, 1.14 ms on
# two; a 16-row decode step's is too small to pay for the hand-off.
SPLIT_MIN_ELEMENTS = 1 << 17


def numpy_silu_mul(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, evaluated now: gate / (1 + exp(-gate)) * x in NumPy (float32)."""
    mx.eval(gate, x)
    g, u = np.asarray(gate), np.asarray(x)   # views of MLX's buffers (strided slices too)
    out = np.empty(np.broadcast_shapes(g.shape, u.shape), np.float32)
    rows = out.shape[0] if out.ndim > 1 else 0
    if out.size >= SPLIT_MIN_ELEMENTS and rows >= 2 and g.shape == u.shape == out.shape:
        m = rows // 2
        half = parked_worker().submit(_silu_mul, g[m:], u[m:], out[m:])
        _silu_mul(g[:m], u[:m], out[:m])
        half.result()
    else:
        _silu_mul(g, u, out)
    return mx.array(out)


def _silu_mul(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    """out = g / (1 + exp(-g)) * u (NumPy's ufuncs release the GIL: two threads run at once)."""
    np.negative(g, out=out)
    with np.errstate(over="ignore"):          # exp(-gate) = inf: gate / inf = -0, as MLX's
        np.exp(out, out=out)
    out += 1
    np.divide(g, out, out=out)
    out *= u


def install_swiglu_hook(model) -> None:
    """Point every module of `model` that calls mlx-lm's `swiglu` at the hook. Idempotent."""
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if getattr(module, "swiglu", None) is _ORIGINAL:
            module.swiglu = _swiglu


def numpy_swiglu(on: bool = True):
    """While inside (and `on`), hooked SwiGLU calls on this thread compute in NumPy."""
    return _SWITCH.set(on)
