"""Small helpers for tests that drive the real Engine on a tiny model."""
import asyncio
import random
import time

from engine.config import EngineConfig
from engine import Engine
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams

PAGE_BYTES_LLAMA = 16 * 2048   # tiny llama: 2 layers x 2 KV heads x 64 dims x (K+V) x 4 bytes


def make_engine(model_dir, pages=64, trace=None, **kw):
    kw.setdefault("page_tokens", 16)
    return Engine(EngineConfig(model=model_dir, kv_budget_bytes=pages * PAGE_BYTES_LLAMA, **kw),
                  trace=trace)


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def req(rid, n_prompt=8, pseed=0, deadline=None, **params):
    """A request with a random prompt (pseed picks it); greedy unless params say otherwise."""
    params.setdefault("temperature", 0.0)
    return GenerationRequest(rid, prompt(n_prompt, pseed), SamplingParams(**params),
                             first_token_deadline=deadline)


async def collect(eng, r, stop_after=None):
    """All deltas of one request (or the first `stop_after`, then close the stream)."""
    out = []
    agen = eng.generate(r)
    async for d in agen:
        out.append(d)
        if stop_after is not None and len(out) >= stop_after:
            await agen.aclose()
            break
    return out


async def started(eng, r):
    """Open a request's stream and wait for its first delta: from then on the request is
    running on the engine (admitted, prefilled). Returns (iterator, [first delta])."""
    agen = eng.generate(r)
    return agen, [await agen.__anext__()]


def tokens(deltas):
    return [t for d in deltas for t in d.token_ids]


def run(coro):
    return asyncio.run(coro)


def wait_idle(eng, timeout=10.0):
    """Stats are published by the engine thread; wait until it reports nothing held."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = eng.stats()
        if (s.num_requests_running == 0 and s.num_requests_waiting == 0
                and s.kv_pages_used == 0 and s.kv_bytes_reserved == 0):
            return s
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {eng.stats()}")
