"""Linear layers that multiply by a transposed view of their weight made once, at load.

Why: mlx's `nn.Linear` computes `x @ weight.T`, and `nn.Embedding.as_linear` (the LM head of
models with tied embeddings) does the same, so every call adds a Transpose node to the step's
graph. A compiled decode step replays its recorded graph each step, views included, and MLX
visits each of its nodes on the host: at batch 1 the engine's step held one per projection
(4 per layer with fused projections) and one for the head, 129 nodes at the Llama-3.1-8B shape
(bench/decode_graph.py). Made once and evaluated, the view is a constant of the graph: the same
buffer with the same strides, so the matmul, its kernel and its result are the ones the
per-call transpose gives, bit for bit, with no copy.

The view is used only while the layer still holds the weight it was made from; a layer whose
weight was replaced (`model.update`, a cast, weights loaded by name) computes `weight.T` per call
again, exactly as mlx does.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

_HELD = "_orchard_transposed"   # instance attribute (not a parameter): (weight, its view)


def transposed_weight(module: nn.Module) -> mx.array:
    """`module.weight.T`: the view made at load while the weight is the one it was made from."""
    w = module["weight"]
    held = module.__dict__.get(_HELD)
    if held is not None:
        if held[0] is w:
            return held[1]
        del module.__dict__[_HELD]   # the weight was replaced: do not keep the old one alive
    return w.T


class PretransposedLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, transposed_weight(self))
        return x @ transposed_weight(self)


class PretransposedEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return x @ transposed_weight(self)


_CLASSES = {nn.Linear: PretransposedLinear, nn.Embedding: PretransposedEmbedding}


def pretranspose(model: nn.Module) -> int:
    """Give every plain `nn.Linear` and `nn.Embedding` in `model` (not subclasses such as the
    quantized layers) its evaluated transposed view, in place; returns how many. Run it after
    engine/model/fuse.py (which fuses plain `nn.Linear` parts only) and after any cast."""
    views = []
    for _, m in model.named_modules():
        cls = _CLASSES.get(type(m), type(m) if type(m) in _CLASSES.values() else None)
        if cls is None:
            continue
        m.__class__ = cls
        w = m["weight"]
        view = w.T
        hold(m, w, view)
        views.append(view)
    mx.eval(views)
    return len(views)


def held_views(model: nn.Module) -> dict[str, mx.array]:
    """{module path: the transposed view it holds} (benches trace with them as named inputs)."""
    return {name: m.__dict__[_HELD][1] for name, m in model.named_modules()
            if _HELD in m.__dict__}


def hold(module: nn.Module, weight: mx.array, view: mx.array) -> None:
    """Make `module` multiply by `view` while it holds `weight` (benches: traced stand-ins)."""
    object.__setattr__(module, _HELD, (weight, view))
