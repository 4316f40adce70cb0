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
the device, the engine per decode-kernel split plan (`--min-keys`) against mlx-lm, and one
layer's attention alone, the paged kernel per plan against mx.fast's SDPA
(bench/decode_time.py). `--variants=` skips the graphs.

Prints JSON: per side both views, `full_model`, and `diff_<variant>_vs_mlx_lm` (nodes, engine
minus mlx-lm, per layer / setup / head).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.graph_count import export, gpu_stand_ins, issued, params_from, summarize, weights_of
from bench.output import run_bench

SHAPES = Path(__file__).parent / "device" / "shapes"
MODELS = Path(__file__).parent.parent / "models"
VARIANTS = ("engine", "engine_uncompiled", "engine_scatter_writes", "mlx_lm")


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
    p.add_argument("--unfused", action="store_true",
                   help="--device-time: also the engine with unfused projections (a second copy "
                        "of the weights)")
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
            tok_in, table = comp.inputs([Chunk(0, [5], context, chunk_pages)], tok)

            def step(tokens, table, **named):
                w = {k: v for k, v in named.items() if not k.startswith("kv.")}
                arrays = [named[f"kv.{i}.{j}"] for i, s in stores
                          for j in range(len(s.arrays()))]
                with params_from(lm.model, w):
                    res = comp._trace(tokens, table, arrays)
                    return [sample(res[0], specs)] + res

            graph = export(step, [tok_in, table], {**weights, **kv})
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
        from bench.decode_time import device_time
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
