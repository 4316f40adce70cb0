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


def store_input_major(model: nn.Module) -> int:
    """Store every pre-transposed layer's weight as a contiguous [in, out] copy (issue 33's
    layout question; benches only, the loader keeps [out, in]). Why: at one token MLX's CUDA
    matmul takes its own GEMV kernel only for `x @ W.T` of a row-major W (`can_use_gemv`: M == 1
    and b transposed, which both mlx-lm and the default layout are); a row-major [in, out]
    weight goes to cuBLAS instead, whose bandwidth at batch 1 is what bench.decode_sweep
    compares. `weight` becomes the copy's transposed view (same shape and values), so the
    memory stays one copy once the old weight is freed. Results differ in rounding only (another
    kernel's summation order). Returns how many layers changed."""
    changed = 0
    for _, m in model.named_modules():
        held = m.__dict__.get(_HELD)
        if held is None or held[0] is not m["weight"]:
            continue
        copy = mx.contiguous(held[1])
        mx.eval(copy)   # one layer at a time: at most one extra weight alive at once
        m.weight = copy.T
        hold(m, m["weight"], copy)
        changed += 1
    return changed


class OneTokenGemvLinear(PretransposedLinear):
    """A linear layer whose one-token calls run the CUDA GEMV kernel (cuda/gemv.py)."""

    def __call__(self, x: mx.array) -> mx.array:
        from engine.attention.cuda import gemv
        if "bias" not in self and gemv.fits(x, self["weight"]):
            return gemv.gemv(x, self["weight"])
        return super().__call__(x)


class OneTokenGemvEmbedding(PretransposedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        from engine.attention.cuda import gemv
        if gemv.fits(x, self["weight"]):
            return gemv.gemv(x, self["weight"])
        return super().as_linear(x)


def use_gemv_kernel(model: nn.Module) -> int:
    """Route the one-token calls of every pre-transposed layer through the CUDA GEMV kernel
    (issue 33's bandwidth question; benches only until measured). Returns how many layers;
    0 where the default device is not a CUDA GPU (the layers stay as they are)."""
    from engine.attention.cuda.paged_decode import available
    if not available():
        return 0
    swap = {PretransposedLinear: OneTokenGemvLinear,
            PretransposedEmbedding: OneTokenGemvEmbedding}
    n = 0
    for _, m in model.named_modules():
        if type(m) in swap:
            m.__class__ = swap[type(m)]
            n += 1
    return n
