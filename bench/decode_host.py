"""Host cost of a decode step: the engine's steady decode on a model so small that Python, not
arithmetic, is the step (SmolLM2's 30 layers and head layout, hidden 72 by default).

    python -m bench.decode_host --batches 1,8 --tokens 128 --repeats 3 [--profile prof.txt]

Prints JSON: per batch, engine ms per decode step (wall and process CPU time, best and median of
`--repeats` runs of `--tokens` tokens per row after a warm-up), and mlx-lm's per-step time on
the same model in the same process (stream_generate at batch 1, BatchGenerator above), so a
change's host cost shows as engine ms per step beside a reference that did not change.
`--profile FILE`: cProfile of the engine thread over one more run per batch (cumulative
top 60), written to FILE.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.engine import compile_choice, engine_decode, mlx_decode
from bench.output import emit

SHAPE = dict(hidden_size=72, num_hidden_layers=30, intermediate_size=128,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             max_position_embeddings=4096)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """`--model` / `--shaped-like` as the benches that take `bench_model` read them."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a model folder (default: a small SmolLM2-shaped llama)")
    src.add_argument("--shaped-like", metavar="DIR",
                     help="random bf16 weights of this model folder's architecture")


def bench_model(args, root: Path) -> tuple[str, object]:
    """(model folder, how results name it) for a bench's `--shaped-like` / `--model` / default
    (the host-bound SmolLM2-layered llama above, built under `root`)."""
    from bench.engine import build_shaped
    from bench.synthetic import build_tiny_model

    if getattr(args, "shaped_like", None):
        return build_shaped(args.shaped_like, root), {
            "random_weights_shaped_like": Path(args.shaped_like).name}
    if args.model:
        return args.model, args.model
    return (str(build_tiny_model("llama", root / "m", seed=0, **SHAPE)),
            {"smollm2_layers_small": SHAPE})


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.decode_host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder (default: the small SmolLM2-shaped llama)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="uncompiled decode steps")
    p.add_argument("--compile", action="store_true", help="compiled decode steps on any backend")
    p.add_argument("--profile", help="write a cProfile of the engine thread here")
    p.add_argument("--out")
    return p.parse_args(argv)


def engine_steps(eng, prompts, n: int, rid: str) -> tuple[float, float]:
    """ms per decode step (wall, process CPU) over the window where every row decodes."""
    wall, cpu = engine_decode(eng, prompts, n, rid)   # tokens/s of all rows together
    return 1000 * len(prompts) / wall, 1000 * len(prompts) / cpu


def run(args) -> dict:
    import random

    from mlx_lm.utils import load

    from engine.config import EngineConfig
    from engine import Engine

    tmp = tempfile.TemporaryDirectory()
    model_dir, shown = bench_model(args, Path(tmp.name))
    batches = [int(x) for x in args.batches.split(",") if x]
    rng = random.Random(0)
    eng = Engine(EngineConfig(model=model_dir, max_num_seqs=max(batches),
                              max_model_len=args.prompt + args.tokens + 16),
                 kernels=compile_choice(args))
    model = tokenizer = None
    if not args.no_mlx_lm:
        model, tokenizer = load(model_dir)
        tokenizer.eos_token_ids = []
    out = {"model": shown, "decode": [],
           "compiled_decode": compile_choice(args).compiled_decode}
    prof_text = io.StringIO()
    try:
        for b in batches:
            ps = [[rng.randrange(3, 200) for _ in range(args.prompt)] for _ in range(b)]
            engine_steps(eng, ps, 8, f"warm{b}")
            if model is not None:
                mlx_decode(model, tokenizer, ps, 8)
            eng_ms, ref_ms = [], []
            for i in range(args.repeats):
                eng_ms.append(engine_steps(eng, ps, args.tokens, f"b{b}-{i}"))
                if model is not None:
                    wall, cpu = mlx_decode(model, tokenizer, ps, args.tokens)
                    ref_ms.append((1000 * b / wall, 1000 * b / cpu))
            point = {"batch": b}
            for name, ms in (("engine", eng_ms), ("mlx_lm", ref_ms)):
                if not ms:
                    continue
                for k, clock in enumerate(("wall", "cpu")):
                    xs = [m[k] for m in ms]
                    point[f"{name}_ms_{clock}_best"] = round(min(xs), 3)
                    point[f"{name}_ms_{clock}_median"] = round(statistics.median(xs), 3)
            if ref_ms:
                point["ratio_cpu_median"] = round(statistics.median(
                    r[1] / e[1] for e, r in zip(eng_ms, ref_ms)), 3)
            out["decode"].append(point)
            print(json.dumps(point), file=sys.stderr)
            if args.profile:
                prof = cProfile.Profile()
                _profile_engine_thread(eng, prof, lambda: engine_steps(eng, ps, args.tokens,
                                                                       f"prof{b}"))
                prof_text.write(f"==== batch {b}\n")
                pstats.Stats(prof, stream=prof_text).sort_stats("cumulative").print_stats(60)
    finally:
        eng.shutdown()
        tmp.cleanup()
    if args.profile:
        Path(args.profile).write_text(prof_text.getvalue())
    return out


def _profile_engine_thread(eng, prof: cProfile.Profile, work) -> None:
    """Profile the engine thread's step runs while `work` runs (the loop's `_run` is wrapped:
    a synchronous step, or a whole decode pipeline)."""
    original = eng._run

    def run(step):
        prof.enable()
        try:
            original(step)
        finally:
            prof.disable()
    eng._run = run
    try:
        t = time.perf_counter()
        work()
        print(f"profiled run: {time.perf_counter() - t:.2f}s", file=sys.stderr)
    finally:
        del eng._run


def main(argv=None) -> int:
    args = parse_args(argv)
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
