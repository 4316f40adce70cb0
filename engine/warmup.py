"""Warm-up: a replica's first decode steps, alone and in a batch, before it takes traffic.

Two things come of it. The first real request does not pay for MLX's first-use costs (kernel
compilation, allocator growth), and the engine's decode step profile (seconds per pure decode
step by batch size, `stats().decode_step_profile`) holds a batch-of-1 and a batch-of-N
measurement, so the capacity actor can fit this model's batch slowdown on this box from its
first heartbeat instead of assuming another model's.

The lone request's decode steps are also returned one by one (`solo_decode_tps`, tokens per
second of each step after the first few): they are decode measurements in this replica's own
execution identity, taken alone on a quiet replica, so the actor counts them as solo samples
(docs/serving.md) and a quantized identity can leave its uncalibrated cap of 1 before traffic.

A replacement replica whose identity the actor has already measured on this chip class
(`profile_known`) runs one short request only: it still pays the first-use costs before traffic
does, but not the batch measurement, which is most of the warm-up and lies on the path of a
service recovering from a lost replica (docs/reliability.md).
"""
from __future__ import annotations

import asyncio
import random
import time

from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams

WARMUP_PROMPT_TOKENS = 16
# More steps than the profile's median window, so the steps that paid first-use costs drop out.
WARMUP_DECODE_TOKENS = 12
# The lone request's first decode steps pay first-use costs: not samples of its rate.
WARMUP_SKIP_STEPS = 3


# Steps of the short warm-up: enough to run a prefill and a few decode steps once.
SHORT_WARMUP_DECODE_TOKENS = 3


async def warm_up(engine, batch: int = 8, seed: int = 0, profile_known: bool = False) -> dict:
    """Decode alone, then `batch` requests together (only one short request alone when the
    profile is known); returns what was measured."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    vocab = engine.vocab_size
    batch = max(1, min(batch, engine.cfg.max_num_seqs))
    gaps: list[float] = []   # seconds between the lone request's tokens

    async def one(i: int, tokens: int = WARMUP_DECODE_TOKENS) -> None:
        prompt = [rng.randrange(1, vocab) for _ in range(WARMUP_PROMPT_TOKENS)]
        req = GenerationRequest(f"warmup-{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True))
        last = None
        async for _ in engine.generate(req):
            now = time.monotonic()
            if i == 0 and last is not None:   # one token per delta: one decode step each
                gaps.append(now - last)
            last = now

    if profile_known:
        await one(0, SHORT_WARMUP_DECODE_TOKENS)
        batch = 1
    else:
        await one(0)
    if batch > 1:
        await asyncio.gather(*(one(i) for i in range(1, batch + 1)))
    engine.evict_prefix_cache()     # random prompts are nobody's prefix
    return {"seconds": time.monotonic() - t0, "batch": batch,
            "decode_step_profile": engine.stats().decode_step_profile,
            "solo_decode_tps": [1.0 / g for g in gaps[WARMUP_SKIP_STEPS:] if g > 0]}
