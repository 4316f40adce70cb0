"""The warm-up returns its lone request's decode steps as solo samples (engine/warmup.py), enough
of them for the actor's rule (5 same-identity solo samples), on a real model and the real
Engine, in a packed format."""
import asyncio

from engine import Engine
from engine.config import EngineConfig
from engine.warmup import WARMUP_DECODE_TOKENS, WARMUP_SKIP_STEPS, warm_up


def test_warmup_returns_one_solo_sample_per_decode_step_after_the_first_few(tiny_llama):
    eng = Engine(EngineConfig(model=tiny_llama, kv_format="int8", page_tokens=16,
                              max_num_seqs=4))
    try:
        done = asyncio.run(warm_up(eng, batch=2))
    finally:
        eng.shutdown()
    samples = done["solo_decode_tps"]
    # 12 tokens: 11 decode steps after the prefill's token, the first 3 dropped.
    assert len(samples) == WARMUP_DECODE_TOKENS - 1 - WARMUP_SKIP_STEPS >= 5
    assert all(s > 0 for s in samples)
