"""A served mix through one engine: what compiled decode steps cost while the batch size wanders.

    python -m bench.decode_mix [--model DIR | --shaped-like DIR] --requests 48 --max-num-seqs 16

Requests arrive evenly over `--spread-s` seconds, with seeded prompt and output lengths; the
engine runs at most `--max-num-seqs` of them, so as requests arrive, rows finish and queued
requests join, the decode batch passes through many sizes and the rows' page tables through
several widths. That is what makes a compiled engine trace (engine/runner/compiled_decode.py):
each new (rows, pages) shape costs one trace, paid by every running row as a stalled step.

Variants, each a fresh engine over the same model and requests, run in turns for `--rounds`
rounds (round 1 also pays the process's first-use kernel compilation, in whichever variant runs
first; later rounds show what a trace costs once MLX's kernels exist):
- plain: uncompiled decode steps;
- exact: compiled steps, one trace per row count (`KernelChoices(compiled_row_buckets=False)`);
- buckets: compiled steps with rows padded to buckets (production's compiled path);
- unmerged: plain, but a mixed step runs one model call per row group instead of one pass over
  the weights for all of them (`KernelChoices(merged_steps=False)`: engine/runner/merged.py);
- `--variant NAME:FIELD=VALUE,...` (repeatable): plain with those KernelChoices fields, e.g.
  `--variant before:cpu_linear=0,cpu_prefill=0 --variant after` (given alone, only these run).
`--max-step-tokens 512,256` runs every variant at each prompt-token budget per step (labels
`plain@256`...): a smaller budget gives the decode rows riding along prefill chunks a token more
often, at the price of more steps.
`--schedule OUT/rate_4/orchard/schedule.json` replays a served run's schedule instead (the
send times and prompt lengths `orchard bench serve` wrote; --requests, --prompt and --tokens
are then ignored; max_tokens from the schedule): the same work in process, without the HTTP,
Ray and client around it, so the served number's serving-path cost shows as the difference.
Prints JSON per variant and round: wall time and generated tokens per second, traces, time to
first token and the gap between a request's successive tokens (median, p99, max; a trace shows
as a long gap), the engine's time in steps with prompt tokens and in decode-only steps, and
wall time as a ratio to the first variant's in the same round.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.cpu_profile import variant_arg
from bench.decode_host import add_model_args
from bench.output import emit, run_bench
from loadtest.report import pct

VARIANTS = ("plain", "exact", "buckets", "unmerged")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.decode_mix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--prompt", type=length_range, default="16,300",
                   help="prompt length range, tokens (LO,HI)")
    p.add_argument("--tokens", type=length_range, default="16,200",
                   help="output length range, tokens (LO,HI)")
    p.add_argument("--variants", default=None,
                   help=f"any of {VARIANTS} (default: all, or none where --variant is given)")
    p.add_argument("--variant", action="append", default=[], type=variant_arg,
                   help="NAME[:FIELD=VALUE,...]: plain with these KernelChoices (repeatable)")
    p.add_argument("--spread-s", type=float, default=2.0,
                   help="requests arrive evenly over this many seconds (0: all at once)")
    p.add_argument("--max-step-tokens", type=step_budgets, default=None,
                   help="comma-separated EngineConfig.max_step_tokens values (default: the "
                        "engine's); each variant runs at each")
    p.add_argument("--schedule", help="a bench-serve schedule.json to replay (send times, "
                   "prompt lengths, max_tokens) instead of the even spread")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    args = p.parse_args(argv)
    if args.variants is None:
        args.variants = "" if args.variant else ",".join(VARIANTS)
    if unknown := set(filter(None, args.variants.split(","))) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    if clash := {name for name, _ in args.variant} & set(VARIANTS):
        p.error(f"--variant: {sorted(clash)} already name built-in variants")
    return args


def kernels_for(variant: str, custom: dict | None = None):
    from engine.attention.choices import KernelChoices
    if custom and variant in custom:
        return KernelChoices(compiled_decode=False, **custom[variant])
    return {"plain": KernelChoices(compiled_decode=False),
            "exact": KernelChoices(compiled_decode=True, compiled_row_buckets=False),
            "buckets": KernelChoices(compiled_decode=True),
            "unmerged": KernelChoices(compiled_decode=False, merged_steps=False)}[variant]


def quantiles(xs: list[float]) -> dict:
    """Median, p99 and max of seconds, in ms (the load test's percentile)."""
    return {"median_ms": round(1000 * pct(xs, 50), 2), "p99_ms": round(1000 * pct(xs, 99), 2),
            "max_ms": round(1000 * max(xs), 2)}


def replayed(path: str) -> list[dict]:
    """The arrivals of a bench-serve schedule.json (t, prompt_tokens, max_tokens each)."""
    import json
    with open(path) as f:
        arrivals = json.load(f).get("arrivals")
    if not arrivals or any(not {"t", "prompt_tokens", "max_tokens"} <= set(a) for a in arrivals):
        raise SystemExit(f"--schedule {path}: not a bench-serve schedule.json "
                         "(needs arrivals with t, prompt_tokens, max_tokens)")
    return sorted(arrivals, key=lambda a: a["t"])


def step_budgets(text: str) -> list[int]:
    """Comma-separated positive token budgets (argparse type)."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token budgets, got {text!r}")
    return out


def length_range(text: str) -> tuple[int, int]:
    """LO,HI token counts, 1 <= LO <= HI (argparse type: a bad range is a usage error)."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI token counts, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def one_mix(engine, requests, spread_s: float, send_at: list[float] | None = None,
            steps: list | None = None) -> dict:
    """Submit the requests evenly over `spread_s` (or at `send_at` seconds each); time each
    one's first token and token gaps. `steps`: the engine's step events (prompt tokens,
    seconds), filled as it runs."""
    async def one(i, r):
        # The arrival schedule, not a wait.
        await asyncio.sleep(send_at[i] if send_at else spread_s * i / len(requests))
        t0, stamps, n = time.perf_counter(), [], 0
        async for d in engine.generate(r):
            if d.token_ids:
                stamps.append(time.perf_counter())
                n += len(d.token_ids)
        return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], n

    async def all_of():
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))

    t0 = time.perf_counter()
    got = asyncio.run(all_of())
    wall = time.perf_counter() - t0
    compiled = engine._parts.runner.compiled
    tokens = sum(n for _, _, n in got)
    steps = steps or []
    return {"wall_s": round(wall, 3), "tokens": tokens, "tok_s": round(tokens / wall, 1),
            "traces": compiled.traces if compiled is not None else 0,
            # to 0.1 ms: at 10 ms a short run's two sums could round past its wall time
            "prompt_steps_s": round(sum(s for n, s in steps if n), 4),
            "decode_steps_s": round(sum(s for n, s in steps if not n), 4),
            "ttft": quantiles([t for t, _, _ in got]),
            "token_gap": quantiles([g for _, gaps, _ in got for g in gaps])}


def run(args) -> dict:
    import random

    import mlx.core as mx

    from bench.decode_host import bench_model
    from bench.kv_runners import progress
    from engine.config import EngineConfig
    from engine import Engine
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    tmp = tempfile.TemporaryDirectory()
    model_dir, shown = bench_model(args, Path(tmp.name))
    rng = random.Random(args.seed)
    (plo, phi), (tlo, thi) = args.prompt, args.tokens
    shapes = [(rng.randint(plo, phi), rng.randint(tlo, thi)) for _ in range(args.requests)]
    send_at = None
    if args.schedule:
        arrivals = replayed(args.schedule)
        shapes = [(a["prompt_tokens"], a["max_tokens"]) for a in arrivals]
        send_at = [a["t"] for a in arrivals]
        phi, thi = max(n for n, _ in shapes), max(n for _, n in shapes)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n, _ in shapes]
    custom = dict(args.variant)
    variants = [v for v in args.variants.split(",") if v] + list(custom)
    result = {"model": shown, "device": str(mx.default_device()), "requests": args.requests,
              "max_num_seqs": args.max_num_seqs, "prompt": args.prompt, "tokens": args.tokens,
              "spread_s": args.spread_s, "schedule": args.schedule, "requests_run": len(shapes),
              "custom_variants": custom,
              "rounds": []}
    for rnd in range(args.rounds):
        row = {}
        result["rounds"].append(row)
        budgets = args.max_step_tokens or [None]
        for v, budget in [(v, b) for v in variants for b in budgets]:
            config = {} if budget is None else {"max_step_tokens": budget}
            steps = []

            def trace(event, **f):
                if event == "step":
                    steps.append((f["prefill_tokens"], f["seconds"]))
            engine = Engine(EngineConfig(model=model_dir, max_num_seqs=args.max_num_seqs,
                                         max_model_len=phi + thi + 16, **config),
                            kernels=kernels_for(v, custom), trace=trace)
            name = v if len(budgets) == 1 else f"{v}@{budget}"
            try:
                reqs = [GenerationRequest(f"mix-{rnd}-{i}", p, SamplingParams(
                    temperature=0.0, max_tokens=n, ignore_eos=True))
                    for i, (p, (_, n)) in enumerate(zip(prompts, shapes))]
                steps.clear()   # the warm-up's, if any
                row[name] = one_mix(engine, reqs, args.spread_s, send_at, steps)
                progress(f"round {rnd + 1}/{args.rounds} {name}: {row[name]['wall_s']} s, "
                         f"{row[name]['tok_s']} tok/s, {row[name]['traces']} traces",
                         bench="decode_mix")
            finally:
                engine.shutdown()
            if args.out:   # after every variant, so a run cut short keeps what it measured
                emit(result, args.out, quiet=True)
        first = next(iter(row))   # the first variant run (plain, plain@N, or the first --variant)
        for v in row:
            row[v][f"wall_to_{first}"] = round(row[v]["wall_s"] / row[first]["wall_s"], 3)
    return result


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
