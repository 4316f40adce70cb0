"""Warm-up: a replica's first decode steps, alone and in a batch, before it takes traffic.

Two things come of it. The first real request does not pay for MLX's first-use costs (kernel
compilation, allocator growth), and the engine's decode step profile (seconds per pure decode
step by batch size, `stats().decode_step_profile`) holds a batch-of-1 and a batch-of-N
measurement, so the capacity actor can fit this model's batch slowdown on this box from its
first heartbeat instead of assuming another model's.
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


async def warm_up(engine, batch: int = 8, seed: int = 0) -> dict:
    """Decode alone, then `batch` requests together; returns what was measured."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    vocab = engine.vocab_size
    batch = max(1, min(batch, engine.cfg.max_num_seqs))

    async def one(i: int) -> None:
        prompt = [rng.randrange(1, vocab) for _ in range(WARMUP_PROMPT_TOKENS)]
        req = GenerationRequest(f"warmup-{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=WARMUP_DECODE_TOKENS, ignore_eos=True))
        async for _ in engine.generate(req):
            pass

    await one(0)
    if batch > 1:
        await asyncio.gather(*(one(i) for i in range(1, batch + 1)))
    engine.evict_prefix_cache()     # random prompts are nobody's prefix
    return {"seconds": time.monotonic() - t0, "batch": batch,
            "decode_step_profile": engine.stats().decode_step_profile}
