"""Greedy tokens of the engine against mlx-lm's on real weights, each divergence judged.

    python -m engine.platform exec python -m bench.greedy_agreement --model smollm2 \
        --formats native,int8 --tokens 64 --out OUT/greedy.json

Chat prompts (the tokenizer's chat template) are decoded greedily, EOS ignored, by mlx-lm (the
reference: its own model code and KV cache, one prompt at a time) and by the Engine in each KV
format, one request at a time and all prompts batched. Where the engine's tokens first differ
from mlx-lm's, the record keeps mlx-lm's two best logits at that position and one bf16 step
at the best logit's magnitude: a divergence is a *near tie* when the two best are within that
step (the order of two equal-within-rounding logits is decided by summation order, which
differs between any two kernels). Anything else is a logic error until shown otherwise. The
engine's own top-2 log-probability gap at the divergence comes from a second, logprobs run.
Prints JSON; a summary per format and mode says how many prompts agree and whether every
divergence is a near tie.

`--noise-floor`: mlx-lm against itself with its q/k/v and gate/up projections fused the
engine's way (engine/model/fuse.py: the same weights, another summation order), judged by the
same rule. Two correct bf16 implementations diverge too; how far apart their top two are where
they do is the yardstick for the engine's divergences. `--dtype bfloat16` runs both sides in
bfloat16 where the model loads in float32 (the CPU), to see the GPU's rounding here.
"""
from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import replace
from pathlib import Path

from bench.cpu_profile import variant_arg
from bench.output import run_bench
from engine.model.names import MODEL_HELP, model_arg

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a ten-year-old.",
    "List three uses of a paperclip.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Why is the sky blue? Keep it short.",
    "Write a Python function that reverses a string.",
    "Give me a recipe for a simple tomato soup.",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.greedy_agreement", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_arg, default="smollm2", help=MODEL_HELP)
    p.add_argument("--formats", default="native,int8",
                   help="engine KV formats, comma-separated; FORMAT+KEY=VALUE[+...] also sets "
                        "EngineConfig fields for that side (e.g. native+prefill_attention=fast: "
                        "prompts through mx.fast's SDPA, cuDNN on CUDA, as mlx-lm's), and "
                        "+kernel.FIELD=VALUE KernelChoices fields (e.g. "
                        "native+kernel.decode_kernel=false: decode through mx.fast's SDPA)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS),
                   help=f"how many of the {len(PROMPTS)} built-in chat prompts")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype of both sides (default: the engine's for the platform, "
                        "mlx-lm's as loaded)")
    p.add_argument("--noise-floor", action="store_true",
                   help="also judge mlx-lm with fused projections against plain mlx-lm")
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    a = p.parse_args(argv)
    if not 1 <= a.prompts <= len(PROMPTS):
        p.error(f"--prompts must be 1..{len(PROMPTS)}")
    if a.tokens < 1:
        p.error("--tokens must be >= 1")
    return a


def bf16_step(x: float) -> float:
    """The gap between adjacent bfloat16 values at |x| (8 significant bits)."""
    if x == 0:
        return 2.0 ** -133
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def reference(model, prompt_ids: list[int], tokens: int) -> tuple[list[int], list[tuple]]:
    """mlx-lm's greedy tokens and, per position, its (best, second) logits."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array(prompt_ids)[None]
    out, tops = [], []
    for _ in range(tokens):
        logits = model(x, cache=cache)[0, -1]
        order = mx.argsort(-logits.astype(mx.float32))[:2]
        top = [float(v) for v in logits[order].astype(mx.float32).tolist()]
        tok = int(order[0].item())
        out.append(tok)
        tops.append((top[0], top[1]))
        x = mx.array([[tok]])
    return out, tops


def engine_tokens(eng, prompts: list[list[int]], tokens: int, batched: bool,
                  logprobs: int | None, tag: str) -> list[tuple[list[int], list]]:
    from engine.request import GenerationRequest
    from engine.sampling.params import SamplingParams

    async def one(i: int, ids: list[int]):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                logprobs=logprobs)
        toks, lps = [], []
        async for d in eng.generate(GenerationRequest(f"{tag}-{i}", ids, params)):
            toks += d.token_ids
            lps += d.logprobs or []
        return toks, lps

    async def go():
        if batched:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        return [await one(i, p) for i, p in enumerate(prompts)]
    return asyncio.run(go())


def judge(ref: list[int], tops: list[tuple], got: list[int], lps: list) -> dict:
    """Where `got` first leaves `ref`, and whether that position is a near tie."""
    n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if n is None:
        return {"agree": len(got) == len(ref), "tokens": len(got)}
    best, second = tops[n]
    rec = {"agree": False, "first_divergence": n, "ref_token": ref[n], "engine_token": got[n],
           "ref_top2_gap": round(best - second, 6), "bf16_step": bf16_step(best),
           "near_tie": best - second <= bf16_step(best)}
    if n < len(lps) and len(lps[n].top) >= 2:
        rec["engine_top2_logprob_gap"] = round(lps[n].top[0][1] - lps[n].top[1][1], 6)
    return rec


def noise_floor(model, prompts: list[list[int]], refs: list[tuple], tokens: int) -> dict:
    """mlx-lm with fused projections (another summation order of the same weights) judged
    against plain mlx-lm's `refs`, one prompt at a time; fuses `model` in place."""
    from engine.model.fuse import fuse_projections
    fused = fuse_projections(model)
    rows = [judge(ref, tops, reference(model, p, tokens)[0], [])
            for p, (ref, tops) in zip(prompts, refs)]
    return {"fused_modules": fused, "agree": sum(r["agree"] for r in rows),
            "every_divergence_near_tie": all(r.get("near_tie", True) for r in rows),
            "rows": rows}


def engine_side(spec: str) -> tuple[str, dict, dict]:
    """(KV format, EngineConfig fields as text (pydantic converts and checks them), KernelChoices
    fields (bench.cpu_profile.variant_arg converts and checks them)) of a --formats entry
    FORMAT[+KEY=VALUE...], KernelChoices fields named kernel.FIELD."""
    fmt, *pairs = spec.split("+")
    engine, kernel = {}, []
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key:
            raise SystemExit(f"--formats {spec!r}: expected FORMAT+KEY=VALUE, got {pair!r}")
        if key.startswith("kernel."):
            kernel.append(f"{key[len('kernel.'):]}={text}")
        else:
            engine[key] = text
    return fmt, engine, variant_arg(fmt + ":" + ",".join(kernel))[1]


def run(args) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    from engine import Engine
    from engine.attention.choices import DEFAULT_KERNELS
    from engine.config import EngineConfig
    from engine.model.names import resolve_model

    path = resolve_model(args.model)
    # Every side's config first: an unknown or ill-typed field is refused before any decoding.
    sides = []
    for spec in args.formats.split(","):
        fmt, fields, kernels = engine_side(spec)
        sides.append((spec, EngineConfig(model=str(path), kv_format=fmt, dtype=args.dtype,
                                         max_num_seqs=len(PROMPTS[:args.prompts]), **fields),
                      replace(DEFAULT_KERNELS, **kernels)))
    model, tok = load(str(path))
    if args.dtype:
        model.set_dtype(getattr(mx, args.dtype))
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in PROMPTS[:args.prompts]]
    refs = [reference(model, p, args.tokens) for p in prompts]
    # The folder's name, not its path: the JSON lands in docs/ (no machine paths there).
    out = {"model": Path(str(path)).name, "device": str(mx.default_device()), "tokens": args.tokens,
           "dtype": args.dtype or "as loaded / the engine's default", "prompts": len(prompts),
           "formats": {}}
    if args.noise_floor:
        out["noise_floor"] = noise_floor(model, prompts, refs, args.tokens)
    del model
    for spec, config, kernels in sides:
        eng = Engine(config, kernels=kernels)
        try:
            res = {}
            for mode in ("one_at_a_time", "batched"):
                plain = engine_tokens(eng, prompts, args.tokens, mode == "batched", None,
                                      f"{spec}-{mode}")
                with_lp = engine_tokens(eng, prompts, args.tokens, mode == "batched", 2,
                                        f"{spec}-{mode}-lp")
                rows = []
                for (ref, tops), (got, _), (got_lp, lps) in zip(refs, plain, with_lp):
                    r = judge(ref, tops, got, lps)
                    r["logprobs_run_same_tokens"] = got_lp == got
                    rows.append(r)
                res[mode] = {"agree": sum(r["agree"] for r in rows),
                             "every_divergence_near_tie": all(r.get("near_tie", True)
                                                              for r in rows),
                             "rows": rows}
            out["formats"][spec] = res
        finally:
            eng.shutdown()
    return out


def main(argv=None) -> int:
    return run_bench(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
