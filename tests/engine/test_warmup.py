"""Warm-up fills the decode step profile with a batch of 1 and a batch of N, and leaves nothing
held behind (pages, reservations, prefix cache)."""
import asyncio

from engine.warmup import warm_up
from tests.engine_helpers import make_engine, wait_idle


def test_warm_up_measures_alone_and_batched_and_leaves_the_engine_idle(tiny_llama):
    eng = make_engine(tiny_llama, pages=64, max_num_seqs=4, enable_prefix_caching=True)
    try:
        done = asyncio.run(warm_up(eng, batch=8))
        assert done["batch"] == 4                    # bounded by max_num_seqs
        profile = done["decode_step_profile"]
        assert 1 in profile and 4 in profile and all(t > 0 for t in profile.values())
        s = wait_idle(eng)
        assert s.decode_step_profile == profile
        assert s.prefix_cache_pages == 0          # random prompts are nobody's prefix
    finally:
        eng.shutdown()
