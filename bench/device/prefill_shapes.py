"""What a prefill of a never-seen shape costs, per way of attending (served GPU runs: every
prefill-carrying step took 80-160 ms whatever its length; a first prefill of a new length took
60-87 ms against 6-11 ms for the same length again).

    python -m bench.device.prefill_shapes --model DIR [--modes fast,ops,bucket64,nocudnn]
        [--lengths 37,61,...] [--long 2048,4096] [--out result.json]

Each mode runs in a fresh process (fresh MLX/cuDNN plan caches) on one in-process Engine:
  fast      EngineConfig.prefill_attention="fast": mx.fast SDPA (cuDNN on CUDA, one plan per
            (queries, keys, mask) shape)
  ops       prefill_attention="ops": MLX matmuls + softmax (engine/attention/ops_prefill.py)
  bucket64  "fast" with prefill_width_bucket=64 (few shapes, padded)
  nocudnn   "fast" with MLX_CUDA_USE_CUDNN_SDPA=0 (MLX's own op fallback inside mx.fast)
  opsbucket64  "ops" with prefill_width_bucket=64 (every matmul M and key count bucketed)
  auto      the engine's defaults
  autonographs  the defaults with MLX_USE_CUDA_GRAPHS=0 (ops launched on the stream, not captured
            and instantiated as a CUDA graph): whether a new shape's remaining 15-25 ms is graph
            instantiation
Phases, each prompt random and never repeated (prefix caching off):
  lone      one request at a time, max_tokens 1, each length first (new shape) then again
            (same shape, new tokens): the prefill steps' seconds from the engine's step events;
  burst     16 requests of 25-400 tokens sent together, 8 tokens each: two bursts of new
            lengths, then the first burst's lengths again; wall seconds and prefill step seconds;
  long      one request per --long length, twice (tokens/s of the second).
Prints one JSON object (and writes it to --out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

MODES = {
    "fast": ({"prefill_attention": "fast"}, {}),
    "ops": ({"prefill_attention": "ops"}, {}),
    "bucket64": ({"prefill_attention": "fast", "prefill_width_bucket": 64}, {}),
    "nocudnn": ({"prefill_attention": "fast"}, {"MLX_CUDA_USE_CUDNN_SDPA": "0"}),
    "opsbucket64": ({"prefill_attention": "ops", "prefill_width_bucket": 64}, {}),
    "auto": ({}, {}),
    "autonographs": ({}, {"MLX_USE_CUDA_GRAPHS": "0"}),
}
LENGTHS = "37,61,90,133,177,250,311,397,512,700,1000,1500"


def child(args) -> dict:
    import mlx.core as mx

    from engine import Engine, GenerationRequest, SamplingParams
    from engine.config import EngineConfig

    knobs, _ = MODES[args.child]
    steps: list[dict] = []

    def trace(event, **f):
        if event == "step":
            steps.append(f)

    cfg = EngineConfig(model=args.model, max_num_seqs=16, max_step_tokens=args.max_step_tokens,
                       kv_budget_bytes=args.kv_gb << 30, max_model_len=8192 + 64, **knobs)
    t0 = time.perf_counter()
    eng = Engine(cfg, trace=trace)
    started = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = 40000

    def prompt(n):
        return [rng.randrange(100, vocab) for _ in range(n)]

    async def one(rid, ids, n_out):
        async for _ in eng.generate(GenerationRequest(
                rid, ids, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))):
            pass

    def run(reqs) -> tuple[float, float]:
        """(wall s, prefill-carrying steps' s) for requests [(ids, n_out)] sent together."""
        mark = len(steps)

        async def go():
            await asyncio.gather(*(one(f"r{rng.random()}", ids, n) for ids, n in reqs))
        t = time.perf_counter()
        asyncio.run(go())
        wall = time.perf_counter() - t
        pre = sum(s["seconds"] for s in steps[mark:] if s["prefill_tokens"] > 0)
        return wall, pre

    lone = []
    for n in [int(x) for x in args.lengths.split(",") if x]:
        first = run([(prompt(n), 1)])[1]
        again = run([(prompt(n), 1)])[1]
        lone.append({"tokens": n, "first_ms": round(first * 1e3, 2),
                     "again_ms": round(again * 1e3, 2)})
    burst_lengths = [[rng.randint(25, 400) for _ in range(16)] for _ in range(2)]
    burst = {}
    for tag, lens in (("new1", burst_lengths[0]), ("new2", burst_lengths[1]),
                      ("again1", burst_lengths[0])):
        wall, pre = run([(prompt(n), 8) for n in lens])
        burst[tag] = {"wall_s": round(wall, 3), "prefill_steps_s": round(pre, 3),
                      "prompt_tokens": sum(lens)}
    long = []
    for n in [int(x) for x in args.long.split(",") if x]:
        run([(prompt(n), 1)])
        wall, pre = run([(prompt(n), 1)])
        long.append({"tokens": n, "prefill_s": round(pre, 4),
                     "tok_per_s": round(n / pre, 1) if pre else None})
    eng.shutdown()
    return {"mode": args.child, "knobs": knobs, "env": MODES[args.child][1],
            "device": str(mx.default_device()), "engine_start_s": round(started, 1),
            "lone": lone, "burst": burst, "long": long}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device.prefill_shapes",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--model", required=True, help="model folder (e.g. a shaped random model)")
    p.add_argument("--modes", default="fast,ops,bucket64,nocudnn",
                   help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--lengths", default=LENGTHS, help="lone prompt lengths, comma list")
    p.add_argument("--long", default="2048,4096", help="long prompt lengths, comma list")
    p.add_argument("--max-step-tokens", type=int, default=2048)
    p.add_argument("--kv-gb", type=int, default=8, help="KV pool GiB per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=240, help="seconds per mode")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"unknown mode {unknown}; known: {', '.join(MODES)}")
    results = {}
    for mode in args.modes.split(","):
        print(f"[prefill_shapes] {mode}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "bench.device.prefill_shapes", "--child", mode,
               "--model", args.model, "--lengths", args.lengths, "--long", args.long,
               "--max-step-tokens", str(args.max_step_tokens), "--kv-gb", str(args.kv_gb),
               "--seed", str(args.seed)]
        try:
            done = subprocess.run(cmd, env={**os.environ, **MODES[mode][1]}, text=True,
                                  capture_output=True, timeout=args.timeout)
            out = done.stdout.strip().splitlines()
            results[mode] = (json.loads(out[-1]) if done.returncode == 0 and out
                             else {"error": done.stderr[-2000:]})
        except subprocess.TimeoutExpired:
            results[mode] = {"error": f"timed out after {args.timeout} s"}
        print(json.dumps({mode: results[mode]}), file=sys.stderr, flush=True)
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
