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

Where decode steps are compiled per shape (CUDA: engine/runner/compiled_decode.py), requests
first join one at a time while the earlier ones decode (`joins`): steps that mix a prefill with
1, 2, ... decode rows, which the lone request and the batch (all arriving together) never run.
Their first-use costs landed in traffic before: on a fresh H200 an 8B replica's first three
mixed steps took 3.7-3.9 s each (docs/lab/benchmarks-serve-gpu.md, run 8). On the CPU nothing
is compiled, so the CPU warm-up (a replica's time to recover) stays as it was.

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
# Joining requests' prompts: from the warm-up's length up to a few pages, so the mixed steps'
# prefill widths are not all one size.
JOIN_PROMPT_TOKENS = (16, 48, 112, 240, 496)
JOINS = 8                   # decode rows 1-7 beside a prefill: row buckets 1, 2, 4 and 8
# Then this many requests at once beside one decoding: steps holding several prompts and a
# decode row, as the first step of a burst of arrivals does. Joins never run that shape, and on
# a fresh H200 its first use took 3.8 s in traffic (SmolLM2, run 11 of
# docs/lab/benchmarks-serve-gpu.md).
BURST = 6
DEFAULT_MODEL_LEN = 4096    # a model length to assume where the config leaves it open


async def warm_up(engine, batch: int = 8, seed: int = 0, profile_known: bool = False,
                  joins_first: bool | None = None, bursts: bool = True) -> dict:
    """Requests joining one by one and then a burst beside a decoding one (`joins_first`;
    None: where decode steps are compiled; `bursts` False: the joins only), then decode
    alone, then `batch` requests together (only one short request alone when the profile is
    known); returns what was measured."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    vocab = engine.vocab_size
    batch = max(1, min(batch, engine.cfg.max_num_seqs))
    gaps: list[float] = []   # seconds between the lone request's tokens

    async def one(i: int, tokens: int = WARMUP_DECODE_TOKENS, prompt_tokens: int =
                  WARMUP_PROMPT_TOKENS, started: asyncio.Event | None = None) -> None:
        prompt = [rng.randrange(1, vocab) for _ in range(prompt_tokens)]
        req = GenerationRequest(f"warmup-{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True))
        last = None
        async for _ in engine.generate(req):
            now = time.monotonic()
            if i == 0 and last is not None:   # one token per delta: one decode step each
                gaps.append(now - last)
            last = now
            if started is not None:
                started.set()

    async def joins(n: int) -> None:
        """n requests, each sent once the one before has its first token: request k's prefill
        shares a step with the k decode rows before it. Each decodes long enough (2 steps per
        later join) to still be running when the last one joins."""
        tokens, tasks = 2 * n + 4, []
        # Every joiner fits the pool and the model's length at once, with room to spare.
        room = min(engine.kvstore.num_pages * engine.kvstore.page_tokens // (2 * n),
                   engine.cfg.max_model_len or DEFAULT_MODEL_LEN) - tokens
        for k in range(n):
            started = asyncio.Event()
            length = max(1, min(JOIN_PROMPT_TOKENS[k % len(JOIN_PROMPT_TOKENS)], room))
            tasks.append(asyncio.create_task(one(100 + k, tokens, length, started)))
            await started.wait()
        await asyncio.gather(*tasks)

    async def burst(n: int) -> None:
        """One request decoding, then n at once: the scheduler packs their prompts (lengths as
        the joins') into steps beside its decode row."""
        started = asyncio.Event()
        first = asyncio.create_task(one(200, 2 * n + 8, WARMUP_PROMPT_TOKENS, started))
        await started.wait()
        room = engine.cfg.max_model_len or DEFAULT_MODEL_LEN
        await asyncio.gather(first, *(
            one(201 + k, 4, max(1, min(JOIN_PROMPT_TOKENS[k % len(JOIN_PROMPT_TOKENS)],
                                       room - 8)))
            for k in range(n)))

    joined = burst_n = 0
    if compiled_steps(engine) if joins_first is None else joins_first:
        # First, so the compiles they pay are not among the measured steps that follow (the
        # lone request's and the batch's refill the profile's batch-1 and batch-N windows).
        joined = min(engine.cfg.max_num_seqs, JOINS)
        await joins(joined)
        burst_n = min(engine.cfg.max_num_seqs - 1, BURST) if bursts else 0
        if burst_n:
            await burst(burst_n)
    if profile_known:
        await one(0, SHORT_WARMUP_DECODE_TOKENS)
        batch = 1
    else:
        await one(0)
    if batch > 1:
        await asyncio.gather(*(one(i) for i in range(1, batch + 1)))
    engine.evict_prefix_cache()     # random prompts are nobody's prefix
    return {"seconds": time.monotonic() - t0, "batch": batch, "joined": joined, "burst": burst_n,
            "decode_step_profile": engine.stats().decode_step_profile,
            "solo_decode_tps": [1.0 / g for g in gaps[WARMUP_SKIP_STEPS:] if g > 0]}


def compiled_steps(engine) -> bool:
    """Whether the engine's decode steps go through compiled per-shape functions (CUDA by
    default; KernelChoices.compiled_decode forces them elsewhere)."""
    return getattr(engine.runner, "compiled", None) is not None
