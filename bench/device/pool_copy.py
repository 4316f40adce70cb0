"""Does a prefill step after compiled decode steps copy the KV pool? (served GPU runs: every
prefill step took 80-120 ms whatever its length, with a 97 GB pool.)

    python -m bench.device.pool_copy --model DIR [--big-gb 40] [--out result.json]

1. MLX alone: a compiled function that returns one of its inputs untouched (as the compiled
   decode step returns pages its CUDA kernel wrote in place), then an ordinary scatter into that
   array: peak memory above the array says whether the scatter copied it.
2. The engine: one request decodes 24 tokens, then a 16-token prompt is prefilled; the prefill
   step's seconds and the peak memory of its release, for a big pool and a small one, with the
   compiled decode step on and off. Prints JSON lines.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import mlx.core as mx

from engine import Engine, GenerationRequest, SamplingParams
from engine.attention.choices import KernelChoices
from engine.config import EngineConfig


def toy(n_bytes: int) -> dict:
    n = n_bytes // 2 // 1024
    f = mx.compile(lambda t, a: [t * 2, a])
    a = mx.zeros((n, 1024), mx.bfloat16)
    mx.eval(a)
    res = {}
    for label in ("after_compiled_identity", "plain"):
        if label == "after_compiled_identity":
            out = f(mx.array([1.0]), a)
            a = out[1]
            mx.eval(out[0])
            del out
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        t0 = time.perf_counter()
        a[mx.array([5])] = mx.ones((1, 1024), mx.bfloat16)
        mx.eval(a)
        mx.synchronize()
        res[label] = {"extra_mib": round((mx.get_peak_memory() - base) / 2**20, 1),
                      "ms": round((time.perf_counter() - t0) * 1e3, 2)}
    return res


async def _go(eng: Engine, rid: str, prompt: list[int], n: int) -> None:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    async for _ in eng.generate(GenerationRequest(rid, prompt, params)):
        pass


def engine_case(model: str, budget: int, compiled: bool) -> dict:
    steps = []
    eng = Engine(EngineConfig(model=model, kv_budget_bytes=budget),
                 trace=lambda e, **f: steps.append((e, f)) if e in ("step", "release") else None,
                 kernels=KernelChoices(compiled_decode=compiled))
    try:
        out = []
        for round_ in range(3):
            asyncio.run(_go(eng, f"d{round_}", list(range(100, 164)), 24))
            steps.clear()
            asyncio.run(_go(eng, f"p{round_}", list(range(200 + round_, 216 + round_)), 1))
            pre = [f for e, f in steps if e == "step" and f["prefill_tokens"]]
            rel = [f for e, f in steps if e == "release"]
            out.append({"prefill_ms": round(pre[0]["seconds"] * 1e3, 1) if pre else None,
                        "release": rel[:1]})
        return {"budget_gb": round(budget / 2**30, 1), "compiled": compiled, "rounds": out}
    finally:
        eng.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device.pool_copy")
    p.add_argument("--model", required=True)
    p.add_argument("--big-gb", type=float, default=40.0)
    p.add_argument("--small-gb", type=float, default=1.0)
    p.add_argument("--toy-mib", type=int, default=4096)
    a = p.parse_args()
    print(json.dumps({"toy": toy(a.toy_mib << 20)}), flush=True)
    for gb in (a.big_gb, a.small_gb):
        for compiled in (True, False):
            print(json.dumps(engine_case(a.model, int(gb * 2**30), compiled), default=str),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
