"""Fused input projections: one matmul for q/k/v and one for gate/up, under mlx-lm's own code.

Why: at small batch a decode step is host-bound. On CUDA every matmul is a kernel node that MLX
adds to a CUDA graph (committed every ~20 nodes) and on the CPU a dispatch; q, k and v (and an
MLP's gate and up) read the same input, so one matmul over their concatenated weights does the
same arithmetic with a third (a half) of the launches. Each output column is still the dot
product of one weight row with the input, so the results are the per-projection ones up to the
backend's blocking of that dot product.

How, without forking mlx-lm's model files: the attention (MLP) module gets one new child,
`qkv_proj` (`gate_up_proj`), holding the concatenated weights, and its `q_proj`, `k_proj`,
`v_proj` become plain callables (`_Part`) that share one `_Fused` slot. The model's code still
calls `self.q_proj(x)`, `self.k_proj(x)`, `self.v_proj(x)` in turn: the first call with a given
`x` runs the fused matmul and splits it; the others are handed their slice of that result. A call
with a different input (a model that projects k/v from something else) computes its own slice
of the fused weight, so the transform never changes what a module computes.

Which modules: plain `nn.Linear` parts (with or without bias, all alike), or `nn.QuantizedLinear`
parts with one group size, bits and mode, and the same input width. Anything else is left as
it is. The parameters live once, in the new child, so parameter counts and byte totals stay
exact; the old names (`q_proj.weight`, ...) are gone from the tree, so fuse after loading and
casting, never before loading weights by name.
"""
from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          ("gate_up_proj", ("gate_proj", "up_proj")))


def _quant_key(m: nn.Module):
    return (m.group_size, m.bits, getattr(m, "mode", "affine"))


def _fusable(parts: list) -> bool:
    if not all(type(p) in (nn.Linear, nn.QuantizedLinear) for p in parts):
        return False
    if len({type(p) for p in parts}) != 1 or len({("bias" in p) for p in parts}) != 1:
        return False
    if len({p.weight.shape[1] for p in parts}) != 1:
        return False
    if isinstance(parts[0], nn.QuantizedLinear):
        return len({_quant_key(p) for p in parts}) == 1 and all("biases" in p for p in parts)
    return True


def _concatenated(parts: list) -> nn.Module:
    """One layer of the parts' own class whose output rows are theirs, in order."""
    fused = copy.copy(parts[0])   # same class and settings (group size, bits, mode, frozen)
    for name in ("weight", "scales", "biases", "bias"):
        if name in fused:
            fused[name] = mx.concatenate([p[name] for p in parts], axis=0)
    return fused


class _Fused:
    """The shared slot: the fused layer, where its output splits, and the last result."""

    def __init__(self, layer: nn.Module, sizes: list[int]):
        self.layer = layer
        self.count = len(sizes)
        self.cuts = [sum(sizes[:i]) for i in range(1, len(sizes))]
        self._x = None
        self._parts = None
        self._pending = 0

    def part(self, i: int, x: mx.array) -> mx.array:
        if self._x is not x:
            # one C++ call for all the slices (per-slice Python indexing cost more host time
            # than the launches it saved, on the CPU profile of a batch-1 step)
            self._parts = mx.split(self.layer(x), self.cuts, axis=-1)
            self._x, self._pending = x, self.count
        out = self._parts[i]
        self._pending -= 1
        if self._pending <= 0:   # every part was handed out: hold no graph past this call
            self._x = self._parts = None
        return out


class _Part:
    """Stands where `q_proj` (etc.) was; called exactly like it."""

    def __init__(self, slot: _Fused, index: int):
        self.slot = slot
        self.index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self.slot.part(self.index, x)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group in `model` in place; returns how many were fused."""
    fused = 0
    for _, module in model.named_modules():
        for new_name, names in GROUPS:
            if new_name in module or not all(n in module for n in names):
                continue
            parts = [module[n] for n in names]
            if not _fusable(parts):
                continue
            slot = _Fused(_concatenated(parts), [p.weight.shape[0] for p in parts])
            module[new_name] = slot.layer
            for i, n in enumerate(names):
                del module[n]
                object.__setattr__(module, n, _Part(slot, i))
            fused += 1
    return fused
