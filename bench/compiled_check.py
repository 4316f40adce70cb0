"""Compiled decode steps against uncompiled ones on one model, step by step (any backend).

    python -m bench.compiled_check [--model DIR | --shaped-like DIR] --batches 1,8 --steps 64

Two runners over the same weights and page tables, one with compiled decode steps
(engine/runner/compiled_decode.py, forced on: `KernelChoices(compiled_decode=True)`) and one
without. On CUDA the uncompiled side's native decode kernel reads keys its store scattered into
the pages, where the compiled side's kernel writes them itself (`--plain-own-writes`: both write
them), so the check compares the two writes too. Each side prefills the same prompts, then
decodes greedily with the previous step's sampled array as input (as pipelined decode does).
Prints JSON per batch: the largest logit difference of any step, whether the greedy tokens
agree, how far apart the pages both sides left are, traces made, the median synchronous step
time of each side (a step built, evaluated and read back; the engine pipelines, so this is a
check of cost, not its served rate) and each side's first step (the compiled side's trace). On
a GPU the compiled side attends through the CUDA decode kernel inside the trace; on the CPU
through gathered, masked pages.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.decode_host import add_model_args
from bench.output import run_bench


# Steps left out of the median step time (the first is the trace; the next settle).
WARM_STEPS = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.compiled_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=100, help="prompt tokens per row")
    p.add_argument("--steps", type=int, default=64,
                   help=f"decode steps per batch (at least {WARM_STEPS + 1}: step times leave "
                        f"out the first {WARM_STEPS})")
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--plain-own-writes", action="store_true",
                   help="the uncompiled side's CUDA decode kernel writes the step's own keys too "
                        "(default: it takes the scatter path, KernelChoices("
                        "decode_writes_own=False), so the check also compares the two writes)")
    p.add_argument("--kv-formats", default="native",
                   help="KV formats to check, comma-separated (packed formats compile only where "
                        "the CUDA kernels attend; elsewhere their point says so)")
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    args = p.parse_args(argv)
    if args.steps <= WARM_STEPS:
        p.error(f"--steps must be at least {WARM_STEPS + 1}, got {args.steps}")
    return args


def interleaved_tables(rows: int, per_row: int) -> list[list[int]]:
    """Page tables whose rows' pages interleave, so a wrong table lookup reads another row's
    keys."""
    return [[r + rows * j for j in range(per_row)] for r in range(rows)]


def make_runner(lm, fmt: str, num_pages: int, page_tokens: int, kernels):
    """A ModelRunner over a fresh store of `num_pages` pages in KV format `fmt`."""
    from engine.attention.layers import packed_layer_factory
    from engine.kv.store import KVStore
    from engine.runner.paged import ModelRunner

    factory = {} if fmt == "native" else {"layer_factory": packed_layer_factory(
        fmt, "direct", lambda n: True, kernels)}
    store = KVStore(lm.geometry, num_pages, page_tokens, lm.dtype, **factory)
    return ModelRunner(lm, store, kernels=kernels)


def decode(runner, prompts, tables, steps):
    """Greedy steps after prefill: (per-step logits as numpy, tokens, step seconds)."""
    import mlx.core as mx
    import numpy as np

    from engine.sched.seq import Chunk

    logits = runner.forward([Chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    toks = mx.argmax(logits, axis=-1).astype(mx.int32)
    lens = [len(p) for p in prompts]
    out, ids, times = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        chunks = [Chunk(i, toks[i:i + 1], lens[i], tables[i]) for i in range(len(lens))]
        logits = runner.forward(chunks, decode_tokens=toks)
        toks = mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(toks, *runner.kvstore.arrays())
        times.append(time.perf_counter() - t0)
        out.append(np.array(logits.astype(mx.float32)))
        ids.append(np.array(toks).tolist())
        lens = [n + 1 for n in lens]
    pages = [np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a)
             for a in runner.kvstore.arrays()]
    return out, ids, times, pages


def run(args) -> dict:
    import mlx.core as mx
    import numpy as np

    from bench.decode_host import bench_model
    from engine.attention.choices import KernelChoices
    from engine.model.loader import load_model

    tmp = tempfile.TemporaryDirectory()
    model_dir, shown = bench_model(args, Path(tmp.name))
    gpu = mx.default_device() != mx.cpu
    lm = load_model(model_dir, dtype="bfloat16" if gpu else "float32", fuse=True)
    rng = np.random.default_rng(0)
    vocab = min(lm.geometry.vocab_size, 256)
    result = {"model": shown, "device": str(mx.default_device()), "batches": []}
    t = args.page_tokens
    points = [(f, int(b)) for f in args.kv_formats.split(",") if f
              for b in args.batches.split(",") if b]
    for fmt, b in points:
        prompts = [rng.integers(3, vocab, args.prompt).tolist() for _ in range(b)]
        per_row = -(-(args.prompt + args.steps + 1) // t)
        tables = interleaved_tables(b, per_row)
        sides = {}
        for name, compiled in (("compiled", True), ("plain", False)):
            kernels = KernelChoices(compiled_decode=compiled,
                                    decode_writes_own=compiled or args.plain_own_writes)
            runner = make_runner(lm, fmt, b * per_row, t, kernels)
            if compiled and runner.compiled is None:
                break
            sides[name] = (*decode(runner, prompts, tables, args.steps), runner)
        if "compiled" not in sides:
            result["batches"].append({"kv_format": fmt, "batch": b,
                                      "compiled": "does not fit this runner here"})
            continue
        (la, ia, ta, pa, ra), (lb, ib, tb, pb, _) = sides["compiled"], sides["plain"]
        point = {"kv_format": fmt, "batch": b, "steps": args.steps,
                 "max_abs_logit_diff": float(max(np.abs(x - y).max() for x, y in zip(la, lb))),
                 "greedy_tokens_equal": ia == ib,
                 "first_token_divergence": next((i for i, (x, y) in enumerate(zip(ia, ib))
                                                 if x != y), None),
                 "pages_max_abs_diff": float(max(np.abs(x.astype(np.float64) - y).max()
                                                 for x, y in zip(pa, pb))),
                 "traces": ra.compiled.traces,
                 "kernel_decode": ra.kernel_decode,
                 "step_ms_median": {side: round(1000 * statistics.median(t[WARM_STEPS:]), 3)
                                    for side, t in (("compiled", ta), ("plain", tb))},
                 # the first decode step of the shape: the compiled side traces it then
                 "first_step_ms": {"compiled": round(1000 * ta[0], 3),
                                   "plain": round(1000 * tb[0], 3)}}
        result["batches"].append(point)
    tmp.cleanup()
    return result


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
