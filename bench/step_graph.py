"""Where a decode step goes: its kernels and its host time, engine against mlx-lm.

    python -m bench.step_graph [--model DIR | --shaped-like DIR] [--batch 1] [--out F]

Two parts, both sides on the same weights, batch 1 by default:
- `time`: synchronous decode steps split into building the graph (Python: the model's code, or
  the engine's table and compiled call), issuing it (`mx.async_eval`: MLX walks the graph and
  encodes every kernel; on CUDA into CUDA graphs it then launches) and waiting for the device
  after that; medians over `--steps`. A pipelined step costs about the larger of build + issue
  (host) and the device's time, so this says which one a side is bound by.
- `kernels` (CUDA only): CUDA graph nodes per decode step, by kernel. MLX writes every CUDA graph
  it launches as a dot file when MLX_SAVE_CUDA_GRAPHS_DOT_FILE is set (read once per process),
  so this part runs in a child process with it set. Each side generates a short and a long greedy
  continuation of one prompt through its real path (the engine's `generate`, mlx-lm's
  `stream_generate`); (long - short) / (extra tokens) is one step's nodes: prefill and set-up
  cancel.
Prints JSON: per side, the medians (ms) and the nodes per step with the most frequent kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.decode_host import add_model_args
from bench.output import run_bench

DOT_ENV = "MLX_SAVE_CUDA_GRAPHS_DOT_FILE"
WARM_STEPS = 4   # left out of the medians (the compiled side traces its first)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.step_graph", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=1, help="rows per decode step")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--kv-format", default="native",
                   help="the engine's KV format (mlx-lm's side is always its own cache)")
    p.add_argument("--steps", type=int, default=64,
                   help=f"timed steps per side (the first {WARM_STEPS} left out)")
    p.add_argument("--parts", default="time,kernels",
                   help="which parts: time, kernels (kernels needs CUDA)")
    p.add_argument("--short", type=int, default=8, help="kernels: tokens of the short run")
    p.add_argument("--long", type=int, default=40, help="kernels: tokens of the long run")
    p.add_argument("--kernels-child", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - {"time", "kernels"})
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(unknown)} (known: time, kernels)")
    if args.steps <= WARM_STEPS or args.batch < 1 or not 0 < args.short < args.long:
        p.error(f"need --steps > {WARM_STEPS}, --batch >= 1 and 0 < --short < --long")
    from capacity.formats import KVFormatError, normalize_format_name
    try:
        args.kv_format = normalize_format_name(args.kv_format)
    except KVFormatError as e:
        p.error(f"--kv-format: {e}")
    args.parts = parts
    return args


# ---- dot files ---------------------------------------------------------------------------

NODE = re.compile(r'^"?(graph_\d+_node_\d+)"?\s*\[(.*?)\];?\s*$', re.S | re.M)
LABEL = re.compile(r'label="((?:[^"\\]|\\.)*)"', re.S)
KERNEL_NAME = re.compile(r"(_Z\w+|void [\w:<>, ]+)")


def node_names(dot: str) -> Counter:
    """Nodes of one CUDA graph dot file by name: a kernel's function (the mangled symbol or
    demangled text, templates cut), else the label's first line that is not the node's index
    (cuBLAS kernels such as `nvjet_...` are not mangled)."""
    out: Counter = Counter()
    for _, attrs in NODE.findall(dot):
        m = LABEL.search(attrs)
        label = m.group(1) if m else attrs
        k = KERNEL_NAME.search(label)
        lines = [ln.strip() for ln in label.splitlines() if ln.strip()]
        name = k.group(1) if k else next((ln for ln in lines if not ln.isdigit()), "?")
        out[re.sub(r"<.*", "", name).strip()[:90]] += 1
    return out


def graphs_since(folder: Path, seen: set) -> tuple[int, Counter]:
    """(new dot files, their nodes by name) in `folder` that are not in `seen` (added to it)."""
    names: Counter = Counter()
    new = sorted(set(folder.glob("*.dot")) - seen)
    for f in new:
        names += node_names(f.read_text(errors="replace"))
        seen.add(f)
    return len(new), names


# ---- the kernels part (child process) ----------------------------------------------------

def kernels_child(args, model_dir: str, folder: Path) -> dict:
    from mlx_lm.utils import load

    from bench.engine import engine_decode, mlx_decode
    from engine.config import EngineConfig
    from engine import Engine

    model, tokenizer = load(model_dir)
    tokenizer.eos_token_ids = []
    prompts = _prompts(args)
    eng = Engine(EngineConfig(model=model_dir, max_num_seqs=args.batch, max_step_tokens=2048,
                              max_model_len=args.prompt + args.long + 16,
                              kv_format=args.kv_format))
    sides = {"engine": lambda n, tag: engine_decode(eng, prompts, n, tag),
             "mlx_lm": lambda n, tag: mlx_decode(model, tokenizer, prompts, n)}
    seen: set = set()
    out = {}
    try:
        for side, run in sides.items():
            for n in (args.short, args.long):   # warm: kernels compiled, shapes traced
                run(n, f"warm{n}")
            graphs_since(folder, seen)
            counts = {}
            for n in (args.short, args.long):
                run(n, f"count{n}")
                counts[n] = graphs_since(folder, seen)
            extra = args.long - args.short
            (g0, c0), (g1, c1) = counts[args.short], counts[args.long]
            per_step = Counter({k: (c1[k] - c0[k]) / extra for k in set(c0) | set(c1)})
            out[side] = {"graphs_per_step": round((g1 - g0) / extra, 2),
                         "nodes_per_step": round(sum(per_step.values()), 1),
                         "by_kernel": {k: round(v, 2) for k, v in per_step.most_common()
                                       if abs(v) >= 0.5}}
    finally:
        eng.shutdown()
    samples = sorted(folder.glob("*.dot"))[-2:]
    out["dot_samples"] = {f.name: f.read_text(errors="replace")[:4000] for f in samples}
    return out


def kernels_part(args) -> dict:
    """Run the kernels part in a child process with MLX's dot dumps on."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "dots"
        folder.mkdir()
        out_file = Path(tmp) / "kernels.json"
        argv = [sys.executable, "-m", "bench.step_graph", "--kernels-child", str(folder),
                "--batch", str(args.batch), "--prompt", str(args.prompt),
                "--short", str(args.short), "--long", str(args.long), "--parts", "kernels",
                "--kv-format", args.kv_format,
                "--out", str(out_file)]
        argv += (["--shaped-like", args.shaped_like] if args.shaped_like
                 else ["--model", args.model] if args.model else [])
        env = dict(os.environ, **{DOT_ENV: str(folder / "g")})
        done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if done.returncode != 0:
            return {"error": done.stderr[-2000:]}
        return json.loads(out_file.read_text())


# ---- the time part -----------------------------------------------------------------------

def _prompts(args) -> list[list[int]]:
    """The same fixed prompts for every part and side: `--batch` rows of `--prompt` tokens."""
    return [[3 + (i * 7 + j) % 200 for j in range(args.prompt)] for i in range(args.batch)]


def split_steps(build, issue_args, steps: int) -> dict:
    """Median ms of build / issue / wait over synchronous steps (`build()` returns the arrays
    to evaluate; `issue_args()` any more, e.g. the KV arrays)."""
    import mlx.core as mx

    parts: dict[str, list[float]] = {"build": [], "issue": [], "wait": [], "step": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        arrays = build()
        t1 = time.perf_counter()
        mx.async_eval(*arrays, *issue_args())
        t2 = time.perf_counter()
        mx.eval(*arrays)
        mx.synchronize()
        t3 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            parts[k].append(1000 * v)
    return {k: round(statistics.median(v[WARM_STEPS:]), 3) for k, v in parts.items()}


def time_part(args, model_dir: str) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from bench.compiled_check import interleaved_tables, make_runner
    from engine.attention.choices import KernelChoices
    from engine.model.loader import load_model
    from engine.sched.seq import Chunk

    b, t = args.batch, 64
    prompts = _prompts(args)
    gpu = mx.default_device() != mx.cpu
    lm = load_model(model_dir, dtype="bfloat16" if gpu else "float32", fuse=True)
    per_row = -(-(args.prompt + args.steps + 1) // t)
    tables = interleaved_tables(b, per_row)
    out = {}
    # The engine as it runs, then with the CUDA decode kernel reading keys the stores
    # scattered (the path before the kernel wrote them itself; the same on the CPU).
    for name, kernels in (("engine", KernelChoices()),
                          ("engine_scatter_writes", KernelChoices(decode_writes_own=False))):
        runner = make_runner(lm, args.kv_format, b * per_row, t, kernels)
        logits = runner.forward([Chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
        state = {"toks": mx.argmax(logits, axis=-1).astype(mx.int32), "n": args.prompt}

        def engine_build(runner=runner, state=state):
            toks, n = state["toks"], state["n"]
            chunks = [Chunk(i, toks[i:i + 1], n, tables[i]) for i in range(b)]
            state["toks"] = mx.argmax(runner.forward(chunks, decode_tokens=toks),
                                      axis=-1).astype(mx.int32)
            state["n"] = n + 1
            return [state["toks"]]

        out[name] = split_steps(engine_build, runner.kvstore.arrays, args.steps)
        out[name]["compiled"] = runner.compiled is not None
        del runner

    model, _ = load(model_dir)
    cache = make_prompt_cache(model)
    ref = {"y": mx.argmax(model(mx.array(prompts), cache=cache)[:, -1, :], axis=-1)[:, None]}

    def mlx_build():   # as mlx-lm's generate_step: logits, log-softmax, argmax
        logits = model(ref["y"], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ref["y"] = mx.argmax(logprobs, axis=-1)[:, None]
        return [ref["y"], logprobs]

    out["mlx_lm"] = split_steps(mlx_build, lambda: [c.state for c in cache], args.steps)
    return out


def run(args) -> dict:
    import mlx.core as mx

    from bench.decode_host import bench_model

    tmp = tempfile.TemporaryDirectory()
    model_dir, shown = bench_model(args, Path(tmp.name))
    if args.kernels_child:
        result = kernels_child(args, model_dir, Path(args.kernels_child))
        tmp.cleanup()
        return result
    result = {"model": shown, "device": str(mx.default_device()), "batch": args.batch,
              "kv_format": args.kv_format,
              "prompt": args.prompt,
              "env": {k: os.environ[k] for k in ("MLX_MAX_OPS_PER_BUFFER",
                                                 "MLX_USE_CUDA_GRAPHS") if k in os.environ}}
    if "time" in args.parts:
        result["time_ms"] = time_part(args, model_dir)
        print(json.dumps(result["time_ms"]), file=sys.stderr, flush=True)
    if "kernels" in args.parts:
        result["kernels"] = (kernels_part(args) if mx.default_device() != mx.cpu else
                             "CUDA only: the CPU backend builds no CUDA graphs")
    tmp.cleanup()
    return result


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
