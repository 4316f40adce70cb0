"""A KV pool that cannot grow while a running request needs its next page: that request finishes
with reason "memory" (the served app ends its stream with a kv_memory_unavailable error event,
or answers 503), its pages and bytes come back, and the engine goes on serving the others.

Admission backs a request's prefill and one more page per running request (`Scheduler._backed`);
later decode pages grow the pool as they come, in the middle of a request's life. The failure is
a fake (KVStore.grow raising MemoryError): a real allocation failure cannot be caused on demand
on a shared machine (it needs another process to take the memory at the right moment).
"""
import asyncio

import pytest

from engine import Engine
from engine.config import EngineConfig
from engine.kv import budget
from engine.kv.store import KVStore
from tests.engine_helpers import (PAGE_BYTES_LLAMA, collect, greq, prompt, run, tokens,
                                  wait_idle)

T = 16


def _failing_grow(self, num_pages):
    raise MemoryError("fake: the memory the budget was planned from is gone")


def _engines(cfg, monkeypatch):
    """An engine with the whole pool, then one whose pool is a 16-page slab that cannot grow
    (one page per sequence), recording the order its requests are refunded in."""
    whole = Engine(cfg)
    monkeypatch.setattr(budget, "FIRST_SLAB_BYTES", 0)
    monkeypatch.setattr(KVStore, "grow", _failing_grow)
    refunds = []

    def trace(event, **fields):
        if event == "refund":
            refunds.append(fields["request"])
    return whole, Engine(cfg, trace=trace), refunds


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_decode_row_whose_page_cannot_be_had_finishes_with_memory_and_others_go_on(
        tiny_llama, monkeypatch, pipelined):
    # Pipelined decode builds the next step before the last one retired (Scheduler.
    # continue_decode); without it every step is built by next_step: both must survive.
    monkeypatch.setattr(Engine, "pipeline_decode", pipelined)
    cfg = EngineConfig(model=tiny_llama, kv_budget_bytes=64 * PAGE_BYTES_LLAMA, page_tokens=T,
                       max_step_tokens=64)
    whole, stuck, refunds = _engines(cfg, monkeypatch)
    # 97 + 15 tokens: 7 pages from its prefill to its end, so it never needs another one.
    fits = greq("fits", prompt(97, seed=7), max_tokens=15)
    # 140 prompt tokens: 9 pages, which fill the 16-page slab with the 7 above; the token at
    # position 144 (its 5th decode step) needs a 10th page, which the pool cannot back.
    grows = greq("grows", prompt(140, seed=8), max_tokens=40)

    async def both(eng):
        # A deadline, not a wait: an engine thread that died leaves both streams open forever.
        return await asyncio.wait_for(
            asyncio.gather(collect(eng, fits), collect(eng, grows)), timeout=120)

    try:
        want_fits, want_grows = run(both(whole))
        got_fits, got_grows = run(both(stuck))
        assert stuck.healthy(), "the engine thread died on a page it could not back"
        assert got_grows[-1].finish_reason == "memory"
        n = len(tokens(got_grows))
        assert 0 < n < 40 and tokens(got_grows) == tokens(want_grows)[:n]
        assert got_fits[-1].finish_reason == "length"
        assert tokens(got_fits) == tokens(want_fits)
        assert refunds[:2] == ["grows", "fits"]   # "fits" ran on after "grows" was turned away
        sched = stuck.scheduler
        assert sched.counters["finished_memory"] == 1
        assert sched.counters["kv_growth_failed"] >= 1
        assert "MemoryError" in sched.last_growth_error
        # Its pages and bytes came back, nothing half-grown, and what fits is still served.
        assert wait_idle(stuck).kv_pages_used == 0
        assert stuck.kvstore.allocated_pages == 16
        sched.pool.check_consistent()
        again = run(collect(stuck, greq("again", prompt(97, seed=7), max_tokens=15)))
        assert tokens(again) == tokens(want_fits)
    finally:
        whole.shutdown()
        stuck.shutdown()


def test_a_page_the_pool_cannot_grow_for_is_taken_from_the_prefix_cache(tiny_llama, monkeypatch):
    """Pages only the prefix cache holds are memory already backed: evicting them comes before
    turning a running request away."""
    cfg = EngineConfig(model=tiny_llama, kv_budget_bytes=64 * PAGE_BYTES_LLAMA, page_tokens=T,
                       max_step_tokens=64, enable_prefix_caching=True)
    whole, stuck, refunds = _engines(cfg, monkeypatch)
    # 97 + 15 tokens leave 6 full pages in the cache; then 140 + 40 tokens need 12 pages of the
    # 10 the 16-page slab has left.
    cached = greq("cached", prompt(97, seed=7), max_tokens=15)
    grows = greq("grows", prompt(140, seed=8), max_tokens=40)

    async def in_turn(eng):
        first = await asyncio.wait_for(collect(eng, cached), timeout=120)
        return first, await asyncio.wait_for(collect(eng, grows), timeout=120)

    try:
        _, want = run(in_turn(whole))
        _, got = run(in_turn(stuck))
        assert stuck.healthy()
        assert got[-1].finish_reason == "length" and tokens(got) == tokens(want)
        sched = stuck.scheduler
        assert sched.counters["kv_growth_failed"] >= 1
        assert sched.counters["prefix_evicted_pages"] >= 1
        assert sched.counters["finished_memory"] == 0
        assert stuck.kvstore.allocated_pages == 16
        stuck.evict_prefix_cache()
        assert wait_idle(stuck).kv_pages_used == 0
        sched.pool.check_consistent()
    finally:
        whole.shutdown()
        stuck.shutdown()
