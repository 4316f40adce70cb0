"""A served schedule replayed through one Engine per KV format, formats interleaved per round.

    python -m bench.decode_mix_kv --model models/smollm2-135m \
        --schedule docs/lab/benchmarks-serve-peers/run9-cpu-decode/schedule_rate_4.json \
        --variants native,k6v4-kivi:unmerged:tiled,k6v4-kivi --rounds 2 --out OUT.json

bench/decode_mix.py's replay (its `replayed` and `one_mix`: the same prompts, send times and
max_tokens for every variant) with the engine's KV format as the variable: a variant is a format
name (`EngineConfig.kv_format`, production's KernelChoices), `:unmerged` adds
`KernelChoices(merged_steps=False)` (a mixed step as one model call per row group, as packed
formats ran before engine/runner/merged.py took them), `:tiled` sets
packed_cache.CPU_PREFILL_COPY_KEYS to 0 for that engine (page-key prefill chunks over history
through the direct path's tiled history, as before that CPU path). Each round runs every
variant in turn, a fresh engine each; every variant's tok/s is also given as a ratio to the
first variant's in the same round.
"""
from __future__ import annotations

import argparse
import random

from bench.decode_mix import one_mix, replayed
from bench.output import emit, run_bench


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.decode_mix_kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder")
    p.add_argument("--schedule", required=True, help="a bench-serve schedule.json to replay")
    p.add_argument("--variants", default="native,k6v4-kivi:unmerged,k6v4-kivi",
                   help="comma-separated FORMAT[:unmerged][:tiled]")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    return p.parse_args(argv)


def run(args) -> dict:
    import mlx.core as mx

    from bench.kv_runners import progress
    from engine import Engine
    from engine.attention import packed_cache
    from engine.attention.choices import KernelChoices
    from engine.config import EngineConfig
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    arrivals = replayed(args.schedule)
    shapes = [(a["prompt_tokens"], a["max_tokens"]) for a in arrivals]
    send_at = [a["t"] for a in arrivals]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n, _ in shapes]
    longest = max(n + m for n, m in shapes) + 16
    result = {"model": args.model, "device": str(mx.default_device()),
              "schedule": args.schedule, "max_num_seqs": args.max_num_seqs,
              "requests_run": len(shapes), "rounds": []}
    variants = args.variants.split(",")
    copy_keys = packed_cache.CPU_PREFILL_COPY_KEYS
    for rnd in range(args.rounds):
        row = {}
        result["rounds"].append(row)
        for v in variants:
            fmt, *modes = v.split(":")
            packed_cache.CPU_PREFILL_COPY_KEYS = 0 if "tiled" in modes else copy_keys
            steps = []

            def trace(event, **f):   # each step's prompt tokens and seconds
                if event == "step":
                    steps.append((f["prefill_tokens"], f["seconds"]))
            engine = Engine(EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs,
                                         max_model_len=longest, kv_format=fmt),
                            kernels=KernelChoices(merged_steps="unmerged" not in modes),
                            trace=trace)
            try:
                reqs = [GenerationRequest(f"mix-{rnd}-{i}", p, SamplingParams(
                    temperature=0.0, max_tokens=n, ignore_eos=True))
                    for i, (p, (_, n)) in enumerate(zip(prompts, shapes))]
                steps.clear()   # the warm-up's
                row[v] = one_mix(engine, reqs, 0.0, send_at, steps)
                row[v]["merged"] = engine._parts.runner.merged is not None
                progress(f"round {rnd + 1}/{args.rounds} {v}: {row[v]['wall_s']} s, "
                         f"{row[v]['tok_s']} tok/s", bench="decode_mix_kv")
            finally:
                engine.shutdown()
                packed_cache.CPU_PREFILL_COPY_KEYS = copy_keys
            if args.out:   # after every variant, so a run cut short keeps what it measured
                emit(result, args.out, quiet=True)
        first = variants[0]
        for v in row:
            row[v][f"tok_s_to_{first}"] = round(row[v]["tok_s"] / row[first]["tok_s"], 3)
    return result


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
