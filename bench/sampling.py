"""Per-token cost of the sampler's per-row options, at batch 1 and 16, printed as JSON.

Two measurements, each option against plain greedy in the same run (alternating, best of
`--repeats`):
- `sampler`: the sampler alone on random float32 logits [B, vocab] (the model's vocabulary),
  ms per step on the wall clock and in process CPU time (all threads; on a shared host the
  wall clock mostly measures the neighbours): `greedy_before` is the argmax the pre-options
  sampler ran for greedy rows, `greedy` the current sampler on the same rows (the no-options
  fast path must cost the same).
- `engine`: the real engine decoding B rows that all carry the option (ignore_eos, same
  prompts), tokens/s over the window where every row decodes, wall and process CPU time.
  Options with penalties or logprobs make a decode step synchronous (no pipelining): that is
  part of their cost and shows here.

    python -m engine.platform exec python -m bench.sampling --model smollm2 \
        --out OUT/x.json
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time

from bench.output import emit
from engine.model.names import MODEL_HELP, model_arg

OPTIONS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "top_p_top_k": dict(temperature=0.8, top_p=0.95, top_k=50),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "logit_bias": dict(temperature=0, logit_bias=tuple((t, -5.0) for t in range(100, 110))),
    "penalties": dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                      repetition_penalty=1.1),
    "logprobs_5": dict(temperature=0, logprobs=5),
    "all": dict(temperature=0.8, top_p=0.95, min_p=0.05, presence_penalty=0.5,
                frequency_penalty=0.5, repetition_penalty=1.1,
                logit_bias=tuple((t, -5.0) for t in range(100, 110)), logprobs=5),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=model_arg, default="smollm2", help=MODEL_HELP)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per row")
    p.add_argument("--steps", type=int, default=50, help="sampler-only steps per timing")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    return p.parse_args(argv)


def sampler_ms(vocab: int, batch: int, options: dict, steps: int, repeats: int,
               history: int) -> dict:
    import mlx.core as mx

    from engine.sampling.params import SamplingParams
    from engine.sampling.sampler import RowSpec, StepLogprobs, sample

    logits = mx.random.normal((batch, vocab), key=mx.random.key(0)) * 4
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(history)]
    output = [rng.randrange(vocab) for _ in range(history // 2)]
    mx.eval(logits)

    def before(rows):   # the pre-options sampler's path for all-greedy rows
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def current(rows):
        drawn = sample(logits, rows)
        lp = StepLogprobs(logits, drawn, rows)
        mx.eval(drawn, *lp.arrays)
        lp.by_row()
        return drawn

    cases = {"greedy_before": (before, OPTIONS["greedy"])}
    cases.update({name: (current, kw) for name, kw in options.items()})
    best: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, (fn, kw) in cases.items():
            rows = [RowSpec(SamplingParams(max_tokens=64, **kw), 7, i, prompt, output)
                    for i in range(batch)]
            mx.eval(fn(rows))   # warm
            wall, cpu = time.perf_counter(), time.process_time()
            for i in range(steps):
                mx.eval(fn(rows))
            ms = [(time.perf_counter() - wall) / steps * 1e3,
                  (time.process_time() - cpu) / steps * 1e3]
            old = best.get(name, ms)
            best[name] = [min(old[0], ms[0]), min(old[1], ms[1])]
    return {k: {"ms": round(v[0], 4), "ms_cpu": round(v[1], 4)} for k, v in best.items()}


def engine_rates(eng, batch: int, options: dict, prompt: int, tokens: int,
                 repeats: int) -> dict:
    from bench.engine import Window
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 5000) for _ in range(prompt)] for _ in range(batch)]
    best: dict[str, list[float]] = {}
    for rep in range(repeats):
        for name, kw in options.items():
            w = Window(batch)

            async def row(i, p, name=name, kw=kw, w=w):
                params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, **kw)
                async for d in eng.generate(GenerationRequest(f"{name}-{batch}-{rep}-{i}", p,
                                                              params)):
                    w.add(i, len(d.token_ids))

            async def go():
                await asyncio.gather(*(row(i, p) for i, p in enumerate(prompts)))
            asyncio.run(go())
            wall, cpu = w.rate()
            old = best.get(name, [0.0, 0.0])
            best[name] = [max(old[0], wall), max(old[1], cpu)]
    base = best["greedy"]
    return {name: {"tok_s": round(v[0], 2), "tok_s_cpu": round(v[1], 2),
                   "vs_greedy": round(v[0] / base[0], 3),
                   "vs_greedy_cpu": round(v[1] / base[1], 3)} for name, v in best.items()}


def run(args) -> dict:
    from engine.config import EngineConfig
    from engine import Engine
    from engine.model.names import resolve_model

    path = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    eng = Engine(EngineConfig(model=path, max_num_seqs=max(batches),
                              kv_budget_bytes=None))
    try:
        vocab = eng.vocab_size
        out = {"model": args.model, "vocab": vocab, "prompt_tokens": args.prompt,
               "decode_tokens": args.tokens, "repeats": args.repeats, "sampler_ms": {},
               "engine": {}}
        for b in batches:
            out["sampler_ms"][str(b)] = sampler_ms(vocab, b, OPTIONS, args.steps, args.repeats,
                                                   args.prompt + args.tokens)
            out["engine"][str(b)] = engine_rates(eng, b, OPTIONS, args.prompt, args.tokens,
                                                 args.repeats)
    finally:
        eng.shutdown()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    emit(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
