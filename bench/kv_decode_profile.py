"""Where a decode step's host time goes, per KV format: cProfile over bench.kv's decode rounds.

    python -m bench.kv_decode_profile --geometry gpu --context 4096 --batch 1 --page-tokens 64 \
        --formats k6v4-kivi --steps 64 --rounds 5 --out F

Why: at batch 1 a GPU decode step is short enough that the Python and MLX calls building and
issuing it can set its rate against native. This separates that host share from the kernels'
(device run 16, 4K batch 1: ~0.08 ms a step of Python over native's ~0.96 ms; the gap was the
kernel's split plan, which `bench.device.kernel_trace` showed). This times the steps bench.kv does
(bench/kv_decode.DecodeTimer, pipelined as the engine decodes), every format set up first and
profiled in turns round by round, so a slow spell of the host lands on each. Prints JSON: per
format, host ms a step (the profiler's total, wait included) and its top functions by own time a
step; per non-native format, the functions whose own time a step differs most from native's.
The profiler's own cost inflates every number alike; compare rows within one run.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

from engine.model.loader import load_model
from bench.kv import GEOMETRIES
from bench.kv_decode import DecodeTimer
from bench.kv_runners import PAGE_TOKENS, page_tokens_arg, progress
from bench.output import run_bench


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="small", choices=sorted(GEOMETRIES),
                    help="bench.kv's synthetic model size (random weights)")
    ap.add_argument("--context", type=int, default=4096, help="keys each row holds already")
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together")
    ap.add_argument("--page-tokens", type=page_tokens_arg, default=PAGE_TOKENS,
                    help=f"tokens a page (default {PAGE_TOKENS}, bench.kv's; the engine's is 64)")
    ap.add_argument("--formats", default="k6v4-kivi",
                    help="decode format specs besides native, comma-separated (bench.kv's "
                         "--decode-formats: FORMAT[:KERNEL])")
    ap.add_argument("--steps", type=int, default=64, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=5, help="profiled rounds a format")
    ap.add_argument("--top", type=int, default=25, help="functions listed a format")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    for name in ("context", "batch", "steps", "rounds", "top"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    return args


def _own_ms(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Own (exclusive) ms a step per function, named file:line(function) without folders."""
    out = {}
    for (file, line, func), (_, _, tottime, _, _) in stats.stats.items():
        name = f"{Path(file).name}:{line}({func})" if file != "~" else func
        out[name] = out.get(name, 0.0) + 1e3 * tottime / steps
    return out


def _diff(fmt: dict[str, float], native: dict[str, float], top: int) -> list:
    """Functions whose own ms a step differ most from native's: [name, format ms, native ms]."""
    names = sorted(set(fmt) | set(native),
                   key=lambda n: -abs(fmt.get(n, 0.0) - native.get(n, 0.0)))
    return [[n, round(fmt.get(n, 0.0), 4), round(native.get(n, 0.0), 4)] for n in names[:top]]


def run(args) -> dict:
    import mlx.core as mx
    from bench.synthetic import build_tiny_model

    model_dir = build_tiny_model("llama", Path(tempfile.mkdtemp()) / "bench",
                                 **GEOMETRIES[args.geometry])
    loaded = load_model(str(model_dir))
    formats = ["native", *(f for f in args.formats.split(",") if f)]
    room = args.steps * (args.rounds + 1)
    pages = args.batch * -(-(args.context + room) // args.page_tokens)
    timers = {}
    for spec in formats:
        timers[spec] = DecodeTimer(loaded, spec, pages, args.batch, args.context, room,
                                   pipelined=True, page_tokens=args.page_tokens)
        timers[spec].round(args.steps)   # warm-up: compiles, kernel builds
    profiles = {spec: cProfile.Profile() for spec in formats}
    seconds = {spec: [] for spec in formats}
    for r in range(args.rounds):
        for spec, timer in timers.items():
            profiles[spec].enable()
            seconds[spec].append(timer.round(args.steps))
            profiles[spec].disable()
        progress(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{s} {1e3 * seconds[s][-1] / args.steps:.3f} ms" for s in formats),
            "kv_decode_profile")
    steps = args.steps * args.rounds
    own = {s: _own_ms(pstats.Stats(profiles[s]), steps) for s in formats}
    result = {"env": {"mlx": mx.__version__, "device": str(mx.default_device()),
                      "geometry": args.geometry, "args": vars(args)}, "formats": {}}
    for spec in formats:
        row = {"profiled_ms_a_step": round(sum(own[spec].values()), 4),
               "round_ms_a_step": [round(1e3 * t / args.steps, 4) for t in seconds[spec]],
               "top_own_ms_a_step": [[n, round(v, 4)] for n, v in sorted(
                   own[spec].items(), key=lambda kv: -kv[1])[:args.top]]}
        if spec != "native":
            row["against_native"] = _diff(own[spec], own["native"], args.top)
        result["formats"][spec] = row
    return result


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
