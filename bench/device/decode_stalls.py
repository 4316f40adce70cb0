"""Stalls after a replica's warm-up: where token gaps jump, with the native decode kernels
compiled at start-up (KernelChoices.precompile_decode) or not, and with the warm-up's joins
(engine/warmup.py: steps mixing a prefill with 1-7 decode rows) or not.

    python -m bench.device.decode_stalls --model DIR [--model DIR ...] --out RESULT.json

Why: on the H200 (docs/lab/benchmarks-serve-gpu.md, run 7) one 8B stream stalled 2.8 s in the
middle of traffic on the first batch-1 step past 256 keys, which the replica's warm-up had not
reached. Each (model, variant) runs in a fresh child process with its own empty MLX PTX cache
(MLX_PTX_CACHE_DIR), as a replica on a new machine starts: the engine with the serving
defaults, the replica's warm-up (engine/warmup.py, batch 8), then lone requests one after
another whose prompts cross the compiled decode step's page buckets (100 to 2,100 tokens), 48
greedy tokens each; then requests joining one at a time while the earlier ones decode (prompts
of 184-510 tokens, as the load generator's warm-up sent them when run 8's 8B replica stalled
3.7-3.9 s in such steps); then a burst (six prompts of 45-380 tokens at once beside a decoding
request, where run 11's SmolLM2 replica stalled 3.8 s). Per request: time to first token, the median and the longest gap
between tokens, and how many compiled decode shapes were traced during it. Prints and writes
JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = (100, 300, 600, 1100, 2100)
DECODE_TOKENS = 48
JOIN_PROMPTS = (184, 510, 507, 300, 420, 250)
# A burst: these arrive at once beside a decoding request (run 11's 64 req/s SmolLM2 replica
# stalled 3.8 s on the first such step, 511 prompt tokens beside one decode row).
BURST_PROMPTS = (120, 45, 310, 60, 230, 380)
# name: (KernelChoices.precompile_decode, warm_up's joins_first, its bursts)
VARIANTS = {"first-use": (False, False, False), "precompiled": (True, False, False),
            "precompiled+joins": (True, True, False),
            "precompiled+joins+burst": (True, True, True)}


def child(model: str, precompile: bool, joins_first: bool, bursts: bool) -> dict:
    from dataclasses import replace

    from engine import Engine, GenerationRequest, SamplingParams
    from engine.attention.choices import DEFAULT_KERNELS
    from engine.config import EngineConfig
    from engine.warmup import warm_up

    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model=model),
                 kernels=replace(DEFAULT_KERNELS, precompile_decode=precompile))
    built = time.perf_counter() - t0
    runner = eng.runner
    compiled = runner.compiled

    async def lone(i: int, n: int, started: asyncio.Event | None = None) -> dict:
        prompt = [3 + (7 * i + 13 * k) % 200 for k in range(n)]   # never a cached prefix
        req = GenerationRequest(f"lone-{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True))
        traces = compiled.traces if compiled else 0
        start = last = time.perf_counter()
        first, gaps = None, []
        async for _ in eng.generate(req):
            now = time.perf_counter()
            if first is None:
                first = now - start
                if started is not None:
                    started.set()
            else:
                gaps.append(now - last)
            last = now
        return {"prompt_tokens": n, "ttft_ms": round(first * 1e3, 1),
                "gap_median_ms": round(statistics.median(gaps) * 1e3, 3),
                "gap_max_ms": round(max(gaps) * 1e3, 1),
                "traces": (compiled.traces if compiled else 0) - traces}

    async def go() -> dict:
        t = time.perf_counter()
        await warm_up(eng, batch=8, joins_first=joins_first, bursts=bursts)
        warm = time.perf_counter() - t
        rows = [await lone(i, n) for i, n in enumerate(PROMPTS)]
        tasks = []
        for k, n in enumerate(JOIN_PROMPTS):   # each joins once the one before has a token
            started = asyncio.Event()
            tasks.append(asyncio.create_task(lone(100 + k, n, started)))
            await started.wait()
        joined = await asyncio.gather(*tasks)
        started = asyncio.Event()   # the burst: one decoding, then the rest at once
        first = asyncio.create_task(lone(200, 400, started))
        await started.wait()
        burst = await asyncio.gather(*(lone(201 + k, n) for k, n in enumerate(BURST_PROMPTS)))
        burst.append(await first)
        return {"warmup_s": round(warm, 2), "requests": rows, "joins": joined,
                "joins_longest_gap_ms": max(r["gap_max_ms"] for r in joined),
                "joins_longest_ttft_ms": max(r["ttft_ms"] for r in joined),
                "burst": burst, "burst_longest_gap_ms": max(r["gap_max_ms"] for r in burst),
                "burst_longest_ttft_ms": max(r["ttft_ms"] for r in burst)}

    out = asyncio.run(go())
    eng.shutdown()
    return {"model": Path(model).name, "precompile_decode": precompile,
            "warmup_joins_first": joins_first, "warmup_bursts": bursts,
            "engine_built_s": round(built, 2), "precompiled_launches": runner.precompiled,
            "compiled_decode": compiled is not None, **out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device.decode_stalls", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="model folder (repeatable)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    p.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model[0], *VARIANTS[args.child])))
        return 0
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; expected {', '.join(VARIANTS)}")
    results = []
    for model in args.model:
        for name in names:
            with tempfile.TemporaryDirectory() as ptx:
                env = {**os.environ, "MLX_PTX_CACHE_DIR": ptx}
                print(f"[decode_stalls] {Path(model).name} {name}", file=sys.stderr, flush=True)
                r = subprocess.run([sys.executable, "-m", "bench.device.decode_stalls",
                                    "--model", model, "--child", name],
                                   env=env, capture_output=True, text=True)
            row = (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else
                   {"model": Path(model).name, "variant": name, "failed": r.stderr[-2000:]})
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
