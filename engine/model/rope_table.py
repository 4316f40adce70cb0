"""RoPE as multiplies by a per-position table, for CPU steps of Llama-family models.

Why (issue 30): MLX's CPU backend has no vector math on x86, so `mx.fast.rope` computes a sine
and a cosine per element per call, one element at a time: 4-5 % of a SmolLM2 decode step and of
a prefill (bench/cpu_profile.py, `rope`), for 60 calls a step (q and k of 30 layers) that all
rotate by the same angles. A rotary embedding is linear in x at a fixed position: each rotated
pair (x1, x2) becomes (a x1 - b x2, b x1 + a x2). Here the module itself is run once over a
probe (x1 = 1, x2 = 0 at every position) to read (a, b) for positions 0..N-1; a step gathers
its rows' positions once and every layer rotates with four multiplies. The values are the
module's own (so scaled variants, e.g. Llama 3's frequency scaling, come out right), and
`for_model` checks the table against the module before anyone uses it.

Only rope classes whose angles depend on the position alone qualify (not dynamic NTK scaling,
whose base depends on the sequence length), and only when every layer rotates the same way.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Positions the table covers at first; it doubles when a step reaches past it.
INITIAL_POSITIONS = 4096


def _position_only_classes() -> tuple[type, ...]:
    from mlx_lm.models.rope_utils import Llama3RoPE
    return (nn.RoPE, Llama3RoPE)


class RopeTable:
    """The rotation of one RoPE module for positions 0..size-1: a, b [size, dims / 2]."""

    def __init__(self, rope, head_dim: int):
        self.rope = rope
        self.head_dim = head_dim
        self.half = rope.dims // 2
        self.traditional = bool(rope.traditional)
        self.size = 0
        self.a = self.b = None

    @classmethod
    def for_model(cls, model) -> "RopeTable | None":
        """The table shared by every attention layer of `model` (an mlx-lm model whose layers
        hold `self_attn.rope`), or None when they do not all rotate the same way by a class whose
        angles depend on the position alone, or when the table does not reproduce the module."""
        inner = getattr(model, "model", None)
        attns = [getattr(layer, "self_attn", None) for layer in getattr(inner, "layers", [])]
        ropes = [getattr(a, "rope", None) for a in attns]
        if not ropes or any(r is None or type(r) not in _position_only_classes() for r in ropes):
            return None
        first = ropes[0]
        if any(_settings(r) != _settings(first) for r in ropes) or first.dims % 2:
            return None
        head_dim = getattr(attns[0], "head_dim", None)
        if not isinstance(head_dim, int):
            return None
        table = cls(first, head_dim)
        return table if table.matches_module() else None

    def _grow(self, n: int) -> None:
        size = max(n, INITIAL_POSITIONS, 2 * self.size)
        probe = np.zeros((1, 1, size, self.head_dim), np.float32)
        probe[..., self._x1] = 1.0
        out = self.rope(mx.array(probe), offset=0)[0, 0]
        self.a, self.b = out[:, self._x1], out[:, self._x2]
        mx.eval(self.a, self.b)
        self.size = size

    @property
    def _x1(self) -> slice:
        return slice(0, 2 * self.half, 2) if self.traditional else slice(0, self.half)

    @property
    def _x2(self) -> slice:
        return (slice(1, 2 * self.half, 2) if self.traditional
                else slice(self.half, 2 * self.half))

    def rotation(self, positions: np.ndarray) -> "Rotation":
        """The rotation of rows at `positions` [rows, width] (int), for x [rows, heads, width,
        head_dim]."""
        top = int(positions.max()) + 1
        if top > self.size:
            self._grow(top)
        idx = mx.array(positions.astype(np.int32))
        return Rotation(self.a[idx][:, None], self.b[idx][:, None], self)

    def matches_module(self, positions=(0, 1, 7, 300, 4095)) -> bool:
        """Whether rotating a random x by the table gives the module's own result."""
        x = mx.random.normal((1, 2, 1, self.head_dim), key=mx.random.key(0))
        for p in positions:
            ref = self.rope(x, offset=p)
            got = self.rotation(np.array([[p]])).apply(x)
            if not mx.allclose(got, ref, atol=1e-5, rtol=1e-5).item():
                return False
        return True


class Rotation:
    """One step's angles, gathered once: `apply` rotates any q or k of that step."""

    def __init__(self, a: mx.array, b: mx.array, table: RopeTable):
        self.a, self.b, self.table = a, b, table

    def apply(self, x: mx.array) -> mx.array:
        t, h = self.table, self.table.half
        if t.traditional:
            pairs = x[..., :2 * h].reshape(*x.shape[:-1], h, 2)
            x1, x2 = pairs[..., 0], pairs[..., 1]
            rot = mx.stack([x1 * self.a - x2 * self.b, x1 * self.b + x2 * self.a], axis=-1)
            rot = rot.reshape(*x.shape[:-1], 2 * h)
        else:
            x1, x2 = x[..., :h], x[..., h:2 * h]
            rot = mx.concatenate([x1 * self.a - x2 * self.b, x1 * self.b + x2 * self.a], axis=-1)
        if 2 * h == x.shape[-1]:
            return rot
        return mx.concatenate([rot, x[..., 2 * h:]], axis=-1)   # partial rotary: rest unrotated


def _settings(rope) -> tuple:
    """What determines a rope module's angles: its class, settings and frequency array."""
    plain = tuple(sorted((k, v) for k, v in vars(rope).items()
                         if not k.startswith("_") and isinstance(v, (int, float, bool, str))))
    freqs = getattr(rope, "_freqs", None)
    return (type(rope), plain, None if freqs is None else tuple(np.asarray(freqs).tolist()))
