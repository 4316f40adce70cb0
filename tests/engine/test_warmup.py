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


def test_where_decode_steps_are_compiled_the_warm_up_runs_mixed_steps_first(tiny_llama):
    """Compiled decode steps (forced on the CPU here, CUDA's default): requests join while the
    earlier ones decode, so steps mixing a prefill with 1..7 decode rows run before traffic,
    then a burst arrives beside a decoding request (several prompts in one step with a decode
    row), all before the measured lone request and batch."""
    from dataclasses import replace

    from engine import Engine
    from engine.attention.choices import DEFAULT_KERNELS
    from engine.config import EngineConfig
    from engine.warmup import BURST, JOINS
    from tests.engine_helpers import PAGE_BYTES_LLAMA

    events = []
    eng = Engine(EngineConfig(model=tiny_llama, page_tokens=16, max_num_seqs=8,
                              kv_budget_bytes=256 * PAGE_BYTES_LLAMA),
                 trace=lambda event, **f: events.append((event, f)),
                 kernels=replace(DEFAULT_KERNELS, compiled_decode=True))
    try:
        done = asyncio.run(warm_up(eng, batch=4))
        assert done["joined"] == JOINS
        steps = [f for e, f in events if e == "step"]
        mixed = {s["decode_rows"] for s in steps if s["prefill_tokens"] and s["decode_rows"]}
        assert mixed >= set(range(1, JOINS)), mixed
        # the burst: several prompts in one step beside a decode row (a burst's first step)
        assert any(s["prefill_rows"] >= 2 and s["decode_rows"] for s in steps)
        assert done["burst"] == BURST
        # the joins came first: every joiner arrived before the measured lone request
        arrivals = [f["request"] for e, f in events if e == "arrival"]
        lone = arrivals.index("warmup-0")
        assert sorted(arrivals[:lone]) == sorted(
            [f"warmup-{100 + k}" for k in range(JOINS)] + [f"warmup-{200 + k}"
                                                           for k in range(BURST + 1)])
        assert wait_idle(eng).prefix_cache_pages == 0
    finally:
        eng.shutdown()


def test_without_compiled_steps_the_warm_up_runs_no_joins(tiny_llama):
    eng = make_engine(tiny_llama, pages=64, max_num_seqs=4)
    try:
        done = asyncio.run(warm_up(eng, batch=2))
        assert done["joined"] == 0 and done["burst"] == 0
    finally:
        eng.shutdown()
