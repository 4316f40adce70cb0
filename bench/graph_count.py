"""Count a lazy MLX graph's primitives by name, shape and dtype, with GPU ops as named nodes.

Used by bench/decode_graph.py (a decode step's graph, engine against mlx-lm). Two views:
`export` (mx.export_function's callback: every primitive of a traced function with its inputs'
shapes and dtypes; named keyword inputs let `summarize` attribute nodes to layers) and `issued`
(mx.export_to_dot of lazy outputs: the graph MLX would evaluate, mx.compile's fused nodes
included). On the CPU backend mx.fast's ops are built from their fallbacks and CUDA kernels
cannot be made, so `gpu_stand_ins` stands one named node in for each (see there).
"""
from __future__ import annotations

import contextlib
import re
import tempfile
from collections import Counter

# Primitives that only reinterpret an array (no kernel on CUDA when the input is contiguous;
# Depends orders, it computes nothing).
VIEWS = {"Reshape", "Slice", "Split", "Transpose", "Broadcast", "Squeeze", "ExpandDims",
         "AsStrided", "Depends", "StopGradient", "Flatten", "Unflatten", "BroadcastAxes"}
LAYER = re.compile(r"layers\.(\d+)\.")


class Graph:
    """One exported function: its primitives in order, with named inputs."""

    def __init__(self):
        self.nodes: list[dict] = []
        self.names: dict[str, str] = {}     # export id -> our name (weights, K/V)
        self.shapes: dict[str, tuple] = {}

    def __call__(self, d: dict) -> None:
        kind = d["type"]
        if kind == "keyword_inputs":
            for name, ident in d["keywords"]:
                self.names[ident] = name
        if kind in ("inputs", "outputs"):
            for ident, shape, dtype in d[kind]:
                self.shapes[ident] = (shape, dtype)
        if kind == "primitive":
            self.nodes.append(d)


def nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.size


def region_of(name: str, layers: int) -> int | None:
    """A named input's rank: its layer, or `layers` for weights after the last layer (final
    norm, LM head), -1 for the embedding (rank of the head when read with a later rank)."""
    if name.startswith("mark."):
        return None
    m = LAYER.search(name)
    if m:
        return int(m.group(1))
    if name.startswith("kv."):
        return int(name.split(".")[1])
    if "embed" in name:
        return -1
    return layers


def summarize(graph: Graph, layers: int) -> dict:
    """Per-layer / setup / head counts and input bytes by primitive."""
    rank: dict[str, int | None] = {i: region_of(n, layers) for i, n in graph.names.items()}
    buckets: dict[str, Counter] = {}
    bytes_in: dict[str, Counter] = {}
    for d in graph.nodes:
        ranks = [rank.get(i) for i, _, _ in d["inputs"]]
        known = [r for r in ranks if r is not None]
        r = max(known) if known else None
        for o, _, _ in d["outputs"]:
            rank[o] = r
        where = ("setup" if r is None or r < 0 else "head" if r >= layers else f"layer{r}")
        name = kernel_name(d["name"], [graph.names.get(i, "") for i, _, _ in d["inputs"]])
        buckets.setdefault(where, Counter())[name] += 1
        bytes_in.setdefault(where, Counter())[name] += sum(nbytes(s, t) for _, s, t in d["inputs"])
    per_layer = [buckets.get(f"layer{i}", Counter()) for i in range(layers)]
    same = all(c == per_layer[0] for c in per_layer)
    mid = layers // 2
    out = {"layers": layers, "layers_identical": same,
           "per_layer": _table(per_layer[mid], bytes_in.get(f"layer{mid}", Counter())),
           "setup": _table(buckets.get("setup", Counter()), bytes_in.get("setup", Counter())),
           "head": _table(buckets.get("head", Counter()), bytes_in.get("head", Counter())),
           "total_nodes": len(graph.nodes)}
    if not same:
        out["per_layer_all"] = [dict(c) for c in per_layer]
    out["total_non_view"] = sum(
        1 for d in graph.nodes
        if kernel_name(d["name"], [graph.names.get(i, "") for i, _, _ in d["inputs"]])
        not in VIEWS)
    return out


def _table(counts: Counter, bytes_in: Counter) -> dict:
    rows = {k: {"n": v, "bytes_in": bytes_in[k]} for k, v in sorted(counts.items())}
    return {"nodes": sum(counts.values()),
            "non_view": sum(v for k, v in counts.items() if k not in VIEWS),
            "by_primitive": rows}


def export(fn, args: list, kwargs: dict) -> Graph:
    """The traced graph of `fn(*args, **kwargs)` (inside `gpu_stand_ins`)."""
    import mlx.core as mx

    def traced(*a, **named):
        return fn(*a, **_use_marks(named))

    g = Graph()
    real_marks = dict(_MARKS)
    try:
        mx.export_function(g, traced, *args, **kwargs, **_marks_for_export())
    finally:
        _MARKS.update(real_marks)
    return g


def issued(outputs: list) -> dict:
    """Labels of the graph MLX would evaluate for `outputs` (fused nodes included)."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs, **{f"mark.{k}": v for k, v in _MARKS.items()})
        dot = f.read()
    inputs: dict[str, list[str]] = {}
    for src, node in re.findall(r'^"([^"]+)" -> (\d+)$', dot, re.M):
        inputs.setdefault(node, []).append(src)
    labels = Counter(kernel_name(label, inputs.get(node, []))
                     for node, label in re.findall(r'\{ (\d+) \[label ="([^"]*)"', dot))
    return {"nodes": sum(labels.values()),
            "non_view": sum(v for k, v in labels.items() if k not in VIEWS),
            "by_label": dict(labels.most_common())}


# ---- GPU kernel stand-ins ------------------------------------------------------------------
#
# On the CPU backend MLX builds mx.fast's ops from their fallbacks (rms_norm as square, mean,
# rsqrt, ...), CUDA kernels cannot be made at all, and a Contiguous node cannot be exported
# (it has no state to serialize). On CUDA each is one node. So while a
# graph is built each is a stand-in: one Depends node whose inputs are the op's real inputs
# plus a marker array named after the op ("mark.<op>"), whose outputs are zeros of the op's
# output shapes. `kernel_name` reads the marker back.

_MARKS: dict = {}     # op name -> its marker array (a tracer while exporting)


def kernel_name(label: str, input_names: list[str]) -> str:
    if label == "Depends":
        for n in input_names:
            if n.startswith("mark."):
                return n[len("mark."):]
    return label


def _marks_for_export() -> dict:
    return {f"mark.{k}": v for k, v in _MARKS.items()}


def _use_marks(named: dict) -> dict:
    """Point the stand-ins at this trace's marker tracers; the other named inputs back."""
    for k in [k for k in named if k.startswith("mark.")]:
        _MARKS[k[len("mark."):]] = named.pop(k)
    return named


@contextlib.contextmanager
def gpu_stand_ins():
    """mx.fast's ops and the CUDA decode kernels as stand-ins (above), and the CUDA kernels
    `available()`, so the runner takes the CUDA path's choices."""
    import mlx.core as mx

    from engine.attention.cuda import native_tiled_decode as ntd
    from engine.attention.cuda import paged_decode as pd

    zeros: dict = {}
    names = ("Contiguous", "RMSNorm", "LayerNorm", "RoPE", "ScaledDotProductAttention",
             "CustomKernel:paged_decode", "CustomKernel:paged_decode_own",
             "CustomKernel:native_tiled_decode", "CustomKernel:native_tiled_decode_own",
             "CustomKernel:decode_merge")
    real_marks = {n: mx.zeros((1,), mx.int32) for n in names}
    mx.eval(list(real_marks.values()))
    _MARKS.clear()
    _MARKS.update(real_marks)

    def node(name, inputs, shapes_dtypes):
        outs = []
        for shape, dtype in shapes_dtypes:
            key = (tuple(shape), dtype)
            if key not in zeros:
                zeros[key] = mx.zeros(shape, dtype)
                mx.eval(zeros[key])
            outs.append(zeros[key])
        return mx.depends(outs, [a for a in inputs if isinstance(a, mx.array)] + [_MARKS[name]])

    def kernel(name):
        def call(inputs, output_shapes, output_dtypes, **_):
            return node(name, inputs, zip(output_shapes, output_dtypes))
        return call

    def contiguous(a, allow_col_major=False):
        return node("Contiguous", [a], [(a.shape, a.dtype)])[0]

    def rms_norm(x, weight, eps, **_):
        return node("RMSNorm", [x, weight], [(x.shape, x.dtype)])[0]

    def layer_norm(x, weight, bias, eps, **_):
        return node("LayerNorm", [x, weight, bias], [(x.shape, x.dtype)])[0]

    def rope(x, dims, *, traditional, base, scale, offset, freqs=None, **_):
        return node("RoPE", [x, offset, freqs], [(x.shape, x.dtype)])[0]

    def sdpa(q, k, v, *, scale, mask=None, sinks=None, **_):
        shape = (*q.shape[:-1], v.shape[-1])
        return node("ScaledDotProductAttention", [q, k, v, mask, sinks], [(shape, q.dtype)])[0]

    fast = mx.fast
    saved = (pd.available, pd._native_kernel, ntd._kernel, pd._merge_kernel, fast.rms_norm,
             fast.layer_norm, fast.rope, fast.scaled_dot_product_attention, mx.contiguous)
    pd.available = lambda: True
    pd._native_kernel = lambda own=False, warps=pd.WARPS: kernel(
        "CustomKernel:paged_decode" + ("_own" if own else ""))
    ntd._kernel = lambda own=False: kernel(
        "CustomKernel:native_tiled_decode" + ("_own" if own else ""))
    pd._merge_kernel = lambda: kernel("CustomKernel:decode_merge")
    fast.rms_norm, fast.layer_norm, fast.rope = rms_norm, layer_norm, rope
    fast.scaled_dot_product_attention = sdpa
    mx.contiguous = contiguous
    try:
        yield
    finally:
        (pd.available, pd._native_kernel, ntd._kernel, pd._merge_kernel, fast.rms_norm,
         fast.layer_norm, fast.rope, fast.scaled_dot_product_attention, mx.contiguous) = saved
        _MARKS.clear()


@contextlib.contextmanager
def params_from(model, given: dict):
    """`model` computes with `given` ({flat name: array}, as `weights_of` names them) while
    inside, transposed views included (engine/model/linear.py: "<module>.weight.T")."""
    from mlx.utils import tree_flatten, tree_unflatten

    from engine.model.linear import held_views, hold

    modules = dict(model.named_modules())
    held = {name: (modules[name]["weight"], view) for name, view in held_views(model).items()}
    params = {k: v for k, v in given.items() if not k.endswith(".weight.T")}
    before = tree_flatten(model.parameters())
    model.update(tree_unflatten(list(params.items())))
    for name in held:
        hold(modules[name], modules[name]["weight"], given[f"{name}.weight.T"])
    try:
        yield
    finally:
        model.update(tree_unflatten(before))
        for name, (w, view) in held.items():
            hold(modules[name], w, view)


def weights_of(model) -> dict:
    """{flat parameter name: array}, and each held transposed view as "<module>.weight.T"."""
    from mlx.utils import tree_flatten

    from engine.model.linear import held_views

    out = dict(tree_flatten(model.parameters()))
    out.update({f"{name}.weight.T": view for name, view in held_views(model).items()})
    return out
