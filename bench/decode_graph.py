"""What one batch-1 decode step's graph holds, engine against mlx-lm, primitive by primitive.

    python -m bench.decode_graph [--shape llama-3.2-1b | --model DIR] [--context 160] [--out F]

No GPU needed: the graphs are built, never run. Both sides get the same random bfloat16 weights
in the geometry of `--shape` (bench/device/shapes/NAME.json, written once under `--cache`), or
the weights of `--model`. The engine takes the choices it takes on CUDA (KernelChoices
defaults: the paged decode kernel, which writes the step's own keys, inside one compiled function
per shape), with each CUDA kernel replaced by a stand-in node ("CustomKernel:<name>": one node
holding the kernel's real inputs; on CUDA it is one CustomKernel primitive). Variants:

- `engine`: the compiled decode step (CompiledDecode._trace) and the sampler (`sample`, greedy);
- `engine_uncompiled`: the same step through `ModelRunner.forward` uncompiled;
- `engine_scatter_writes`: compiled, but the stores scatter the step's K/V
  (KernelChoices(decode_writes_own=False));
- `mlx_lm`: mlx-lm's generate_step: model(y[None], cache=KVCache...) at the same context, the
  last position's logits, log-softmax and argmax.

Two views per side:
- `traced`: every primitive of the step's graph (mx.export_function's callback: names, shapes,
  dtypes), split into `per_layer` (nodes that read a layer's weights or K/V, or whose inputs
  do; the layers are checked identical and one is shown), `setup` (nodes that read no weight:
  token and page-table arithmetic, masks, kernels' constants) and `head` (the final norm, LM
  head and sampling). `bytes_in` per primitive: bytes its inputs hold (a matmul's weight, a
  copy's source; views move none). View primitives (reshape, slice, transpose, ...) launch no
  kernel on CUDA when their input is contiguous.
- `issued`: the graph MLX evaluates (mx.export_to_dot of the step's outputs): for the compiled
  engine, mx.compile's fused kernels ("Compiled...") replace chains of elementwise nodes; for
  mlx-lm, its compiled SwiGLU. Totals by label, and an estimate of launched kernels (non-view
  nodes).

`full_model`: the totals at the shape's own layer count (`--layers N` builds fewer layers to save
memory, e.g. the 8B geometry with 2; per-layer counts do not depend on it). Setup nodes include
the embedding lookup (its input bytes are the whole table; it reads one row).

`--device-time` (meant for CUDA; elsewhere a smoke test of the code): batch-1 decode timed on
the device, the engine per decode-kernel split plan (`--min-keys`) against mlx-lm (see
`device_time`). `--variants=` skips the graphs.

Prints JSON: per side both views, `full_model`, and `diff_<variant>_vs_mlx_lm` (nodes, engine
minus mlx-lm, per layer / setup / head).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import tempfile
from collections import Counter
from pathlib import Path

from bench.output import run_bench

SHAPES = Path(__file__).parent / "device" / "shapes"
MODELS = Path(__file__).parent.parent / "models"
VARIANTS = ("engine", "engine_uncompiled", "engine_scatter_writes", "mlx_lm")
# Primitives that only reinterpret an array (no kernel on CUDA when the input is contiguous;
# Depends orders, it computes nothing).
VIEWS = {"Reshape", "Slice", "Split", "Transpose", "Broadcast", "Squeeze", "ExpandDims",
         "AsStrided", "Depends", "StopGradient", "Flatten", "Unflatten", "BroadcastAxes"}
LAYER = re.compile(r"layers\.(\d+)\.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.decode_graph", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", default="llama-3.2-1b",
                     help="a geometry in bench/device/shapes (random bf16 weights)")
    src.add_argument("--model", help="a model folder instead (its own weights)")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "orchard-decode-graph"),
                   help="where --shape's random model folder is written once and reused")
    p.add_argument("--tokenizer-from", default=None,
                   help="--shape: the tokenizer files' folder (default: models/smollm2-135m, "
                        "whose vocabulary the shapes use, else the tracked models/orchard-tiny: "
                        "the graphs never decode text)")
    p.add_argument("--layers", type=int,
                   help="--shape with this many layers (per-layer counts do not depend on it; "
                        "`full_model` scales them to the shape's own count)")
    p.add_argument("--context", type=int, default=160,
                   help="tokens already in the KV cache before the step")
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of: {', '.join(VARIANTS)} (empty: none, e.g. with "
                        "--device-time alone)")
    p.add_argument("--no-issued", action="store_true", help="skip the issued (dot) view")
    p.add_argument("--device-time", action="store_true",
                   help="CUDA only: also time batch-1 decode, engine per --min-keys against "
                        "mlx-lm (see device_time)")
    p.add_argument("--min-keys", default="default,64,32,16",
                   help="--device-time: the engine's decode_split_min_keys values "
                        "('default': the kernel's own)")
    p.add_argument("--steps", type=int, default=96, help="--device-time: steps per round")
    p.add_argument("--rounds", type=int, default=3, help="--device-time: alternating rounds")
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(args.variants) - set(VARIANTS))
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}")
    if args.context < 1:
        p.error("--context must be >= 1")
    if not args.model and not (SHAPES / f"{args.shape}.json").exists():
        p.error(f"no shape {args.shape!r} in {SHAPES}")
    return args


def model_folder(args) -> str:
    if args.model:
        return args.model
    from bench.device.shaped_models import source_folder
    from bench.engine import build_shaped

    name = args.shape if args.layers is None else f"{args.shape}-L{args.layers}"
    root = Path(args.cache)
    out = root / f"{name}-random"
    if not (out / "model.safetensors").exists():
        tok = Path(args.tokenizer_from) if args.tokenizer_from else next(
            m for m in (MODELS / "smollm2-135m", MODELS / "orchard-tiny")
            if (m / "tokenizer.json").exists())
        src = source_folder(args.shape, tok, root)
        if args.layers is not None:
            config = json.loads((src / "config.json").read_text())
            config["num_hidden_layers"] = args.layers
            src = src.rename(src.with_name(name))
            (src / "config.json").write_text(json.dumps(config, indent=1))
        build_shaped(str(src), root, "bfloat16")
    return str(out)


def shape_layers(args) -> int | None:
    if args.model:
        return None
    return json.loads((SHAPES / f"{args.shape}.json").read_text())["num_hidden_layers"]


# ---- graphs ------------------------------------------------------------------------------

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
    out["total_non_view"] = sum(1 for d in graph.nodes if d["name"] not in VIEWS)
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

    from engine.attention.cuda import paged_decode as pd

    zeros: dict = {}
    names = ("Contiguous", "RMSNorm", "LayerNorm", "RoPE", "ScaledDotProductAttention",
             "CustomKernel:paged_decode", "CustomKernel:paged_decode_own",
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
    saved = (pd.available, pd._native_kernel, pd._merge_kernel, fast.rms_norm,
             fast.layer_norm, fast.rope, fast.scaled_dot_product_attention, mx.contiguous)
    pd.available = lambda: True
    pd._native_kernel = lambda own=False: kernel("CustomKernel:paged_decode"
                                                 + ("_own" if own else ""))
    pd._merge_kernel = lambda: kernel("CustomKernel:decode_merge")
    fast.rms_norm, fast.layer_norm, fast.rope = rms_norm, layer_norm, rope
    fast.scaled_dot_product_attention = sdpa
    mx.contiguous = contiguous
    try:
        yield
    finally:
        (pd.available, pd._native_kernel, pd._merge_kernel, fast.rms_norm, fast.layer_norm,
         fast.rope, fast.scaled_dot_product_attention, mx.contiguous) = saved
        _MARKS.clear()


@contextlib.contextmanager
def params_from(model, given: dict):
    """`model` computes with `given` ({flat name: array}) while inside."""
    from mlx.utils import tree_flatten, tree_unflatten

    before = tree_flatten(model.parameters())
    model.update(tree_unflatten(list(given.items())))
    try:
        yield
    finally:
        model.update(tree_unflatten(before))


def weights_of(model) -> dict:
    from mlx.utils import tree_flatten
    return dict(tree_flatten(model.parameters()))


# ---- the engine --------------------------------------------------------------------------

def engine_side(model_dir: str, variant: str, context: int, page_tokens: int,
                with_issued: bool) -> dict:
    import mlx.core as mx

    from bench.compiled_check import make_runner
    from engine.attention.choices import KernelChoices
    from engine.model.loader import load_model
    from engine.sampling.params import SamplingParams
    from engine.sampling.sampler import RowSpec, sample
    from engine.sched.seq import Chunk

    kernels = {"engine": KernelChoices(),
               "engine_uncompiled": KernelChoices(compiled_decode=False),
               "engine_scatter_writes": KernelChoices(decode_writes_own=False,
                                                      compiled_decode=True)}[variant]
    lm = load_model(model_dir, dtype="bfloat16", fuse=True)
    layers = lm.geometry.num_layers
    pages = -(-(context + 1) // page_tokens)
    with gpu_stand_ins():
        runner = make_runner(lm, "native", pages + 1, page_tokens, kernels)
        chunk_pages = list(range(pages))
        specs = [RowSpec(SamplingParams(temperature=0.0), 0, 0)]
        weights = weights_of(lm.model)
        stores = [(i, runner.kvstore.layer(i)) for i in lm.geometry.paged_layers]
        kv = {f"kv.{i}.{j}": a for i, s in stores for j, a in enumerate(s.arrays())}
        tok = mx.array([5], dtype=mx.int32)
        out = {"kernel_decode": runner.kernel_decode, "compiled": runner.compiled is not None}
        if runner.compiled is not None:
            comp = runner.compiled
            from engine.runner.compiled_decode import bucket_pages

            width = bucket_pages(pages)
            table = mx.array([[context] + chunk_pages + [chunk_pages[0]] * (width - pages)],
                             dtype=mx.int32)

            def step(tokens, table, **named):
                w = {k: v for k, v in named.items() if not k.startswith("kv.")}
                arrays = [named[f"kv.{i}.{j}"] for i, s in stores
                          for j in range(len(s.arrays()))]
                with params_from(lm.model, w):
                    res = comp._trace(tokens, table, arrays)
                    return [sample(res[0], specs)] + res

            graph = export(step, [tok, table], {**weights, **kv})
        else:
            def step(tokens, **named):
                w = {k: v for k, v in named.items() if not k.startswith("kv.")}
                saved = [s.arrays() for _, s in stores]
                for i, s in stores:
                    s.adopt([named[f"kv.{i}.{j}"] for j in range(len(s.arrays()))])
                try:
                    with params_from(lm.model, w):
                        logits = runner.forward([Chunk(0, [5], context, chunk_pages)],
                                                decode_tokens=tokens)
                        return [sample(logits, specs), logits] + [
                            a for _, s in stores for a in s.arrays()]
                finally:
                    for (_, s), a in zip(stores, saved):
                        s.adopt(a)

            graph = export(step, [tok], {**weights, **kv})
        out["traced"] = summarize(graph, layers)
        if with_issued:
            logits = runner.forward([Chunk(0, [5], context, chunk_pages)], decode_tokens=tok)
            out["issued"] = issued([sample(logits, specs)] + runner.kvstore.arrays())
    return out


# ---- mlx-lm ------------------------------------------------------------------------------

def mlx_lm_side(model_dir: str, context: int, with_issued: bool) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(model_dir)
    # One real call first, as generate_step's prefill does: arrays the model derives once
    # (Llama3RoPE's frequencies) are then evaluated, not part of every step's graph.
    mx.eval(model(mx.array([[1]]), cache=make_prompt_cache(model)))
    cache = make_prompt_cache(model)
    layers = len(cache)
    probe_k = []
    for layer in model.model.layers:
        attn = layer.self_attn
        probe_k.append((attn.n_kv_heads, model.args.head_dim
                        or model.args.hidden_size // model.args.num_attention_heads))
    step_tokens = cache[0].step
    n = -(-(context + 1) // step_tokens) * step_tokens
    for c, (kvh, hd) in zip(cache, probe_k):
        c.keys = mx.zeros((1, kvh, n, hd), mx.bfloat16)
        c.values = mx.zeros((1, kvh, n, hd), mx.bfloat16)
        mx.eval(c.keys, c.values)
    weights = weights_of(model)
    kv = {f"kv.{i}.{j}": a for i, c in enumerate(cache) for j, a in enumerate((c.keys, c.values))}

    def reset():
        for i, c in enumerate(cache):
            c.keys, c.values, c.offset = kv[f"kv.{i}.0"], kv[f"kv.{i}.1"], context

    def generate_step(y):   # mlx_lm.generate.generate_step's _step, greedy sampler
        logits = model(y[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return [mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)]

    def step(y, **named):
        w = {k: v for k, v in named.items() if not k.startswith("kv.")}
        for i, c in enumerate(cache):
            c.keys, c.values, c.offset = named[f"kv.{i}.0"], named[f"kv.{i}.1"], context
        with params_from(model, w):
            return generate_step(y)

    y = mx.array([5], dtype=mx.uint32)
    with gpu_stand_ins():
        graph = export(step, [y], {**weights, **kv})
        reset()
        out = {"traced": summarize(graph, layers)}
        if with_issued:
            out["issued"] = issued(generate_step(y))
            reset()
    return out


# ---- device time (CUDA) ------------------------------------------------------------------

def device_time(args, model_dir: str) -> dict:
    """Batch-1 decode after `--context` prompt tokens, on the device: the engine's compiled step
    (production's choices but the decode kernel's split plan, `decode_split_min_keys`) and
    mlx-lm's generate_step, same weights, alternating rounds. Per side and round: ms per token
    pipelined (step n+1 queued before step n is read back, as both serve) and the medians of
    synchronous steps split into build / issue / wait (bench.step_graph.split_steps). What it
    tests: whether the paged decode kernel's serial walk over the keys (one split at short
    contexts: rows * KV heads blocks of 4 warps) is the engine's extra time per step."""
    import statistics
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from bench.compiled_check import make_runner
    from bench.step_graph import split_steps
    from engine.attention.choices import KernelChoices
    from engine.attention.cuda import paged_decode as pd
    from engine.model.loader import load_model
    from engine.runner.compiled_decode import bucket_pages
    from engine.sampling.params import SamplingParams
    from engine.sampling.sampler import RowSpec, sample
    from engine.sched.seq import Chunk

    gpu = pd.available()   # elsewhere the step gathers pages (a smoke test of this code only)
    t, ctx, n = args.page_tokens, args.context, args.steps
    pages = -(-(ctx + n + 3) // t)   # every round rewinds to `ctx` (rewind below)
    table = list(range(pages))
    prompt = [3 + j % 200 for j in range(ctx)]
    specs = [RowSpec(SamplingParams(temperature=0.0), 0, 0)]
    lm = load_model(model_dir, dtype="bfloat16", fuse=True)
    kvh = lm.geometry.layers[0].kv_heads
    sides: dict = {}
    for mk in [x for x in args.min_keys.split(",") if x]:
        keys = None if mk == "default" else int(mk)
        runner = make_runner(lm, "native", pages, t, KernelChoices(
            decode_split_min_keys=keys, compiled_decode=None if gpu else True))
        first = mx.argmax(runner.forward([Chunk(0, prompt, 0, table)]), axis=-1).astype(mx.int32)
        mx.eval(first, runner.kvstore.arrays())
        state = {"toks": first, "n": ctx}

        def launch(runner=runner, state=state):
            logits = runner.forward([Chunk(0, [0], state["n"], table)],
                                    decode_tokens=state["toks"])
            state["toks"], state["n"] = sample(logits, specs), state["n"] + 1
            return [state["toks"]]

        capacity = bucket_pages(ctx // t + 1) * t   # the compiled step's split plan reads it
        sides[f"engine_min_keys_{mk}"] = {
            "launch": launch, "arrays": runner.kvstore.arrays, "state": state,
            "splits_at_start": pd.split_count(1, kvh, capacity, None, keys),
            "compiled": runner.compiled is not None, "reset": ctx}
    model, _ = load(model_dir)
    cache = make_prompt_cache(model)
    ref = {"y": mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1, :], axis=-1)}
    mx.eval(ref["y"], [c.state for c in cache])

    def mlx_launch():   # generate_step's _step, greedy
        logits = model(ref["y"][None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        ref["y"] = mx.argmax(logprobs, axis=-1)
        return [ref["y"], logprobs]

    sides["mlx_lm"] = {"launch": mlx_launch, "arrays": lambda: [c.state for c in cache]}

    def pipelined(side, n=n) -> float:
        prev = None
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            out = side["launch"]()
            mx.async_eval(*out, side["arrays"]())
            if prev is not None:
                prev.item()
            prev = out[0]
        prev.item()
        return 1000 * (time.perf_counter() - t0) / n

    def rewind(side):   # every round decodes from the same context length
        if "state" in side:
            side["state"]["n"] = side["reset"]
        else:
            for c in cache:
                c.offset = ctx

    results = {k: {"ms_per_token": [], "sync": []} for k in sides}
    for side in sides.values():   # traces, kernel builds and every page bucket, unrecorded
        rewind(side)
        pipelined(side, n + 2)
    for _ in range(args.rounds):
        for name, side in sides.items():
            rewind(side)
            results[name]["ms_per_token"].append(round(pipelined(side), 3))
            rewind(side)
            results[name]["sync"].append(split_steps(side["launch"], side["arrays"], n))
    out = {"context": ctx, "steps": n, "rounds": args.rounds, "decode_kernel": gpu}
    for name, r in results.items():
        med = statistics.median(r["ms_per_token"])
        out[name] = {"ms_per_token": r["ms_per_token"], "tok_s_median": round(1000 / med, 1),
                     "sync_median": {k: statistics.median(s[k] for s in r["sync"])
                                     for k in r["sync"][0]}}
        for k in ("splits_at_start", "compiled"):
            if k in sides[name]:
                out[name][k] = sides[name][k]
    base = statistics.median(results["mlx_lm"]["ms_per_token"])
    for name in results:
        out[name]["vs_mlx_lm"] = round(base / statistics.median(results[name]["ms_per_token"]), 3)
    return out


def diff(a: dict, b: dict) -> dict:
    """a - b by primitive (nodes), leaving out zeros."""
    ka, kb = a["by_primitive"], b["by_primitive"]
    return {k: ka.get(k, {}).get("n", 0) - kb.get(k, {}).get("n", 0)
            for k in sorted(set(ka) | set(kb))
            if ka.get(k, {}).get("n", 0) != kb.get(k, {}).get("n", 0)}


def run(args) -> dict:
    import mlx.core as mx

    model_dir = model_folder(args)
    out = {"model": args.model or {"random_bf16_shaped_like": args.shape},
           "device": str(mx.default_device()), "context": args.context,
           "page_tokens": args.page_tokens, "batch": 1}
    for v in args.variants:
        out[v] = (mlx_lm_side(model_dir, args.context, not args.no_issued) if v == "mlx_lm"
                  else engine_side(model_dir, v, args.context, args.page_tokens,
                                   not args.no_issued))
    if args.device_time:
        out["device_time"] = device_time(args, model_dir)
    full = shape_layers(args)
    for v in args.variants:
        t = out[v]["traced"]
        layers = full or t["layers"]
        out[v]["full_model"] = {
            "layers": layers,
            "nodes": t["setup"]["nodes"] + t["head"]["nodes"] + layers * t["per_layer"]["nodes"],
            "non_view": (t["setup"]["non_view"] + t["head"]["non_view"]
                         + layers * t["per_layer"]["non_view"])}
    if "mlx_lm" in out:
        ref = out["mlx_lm"]["traced"]
        for v in args.variants:
            if v == "mlx_lm":
                continue
            t = out[v]["traced"]
            out[f"diff_{v}_vs_mlx_lm"] = {
                "per_layer": diff(t["per_layer"], ref["per_layer"]),
                "setup": diff(t["setup"], ref["setup"]),
                "head": diff(t["head"], ref["head"])}
    return out


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
