"""A KV pool that cannot grow turns requests away at admission; the engine goes on serving.

The pool grows at admission (`Scheduler._backed` -> `PagePool.back`) to cover the new request's
prefill and one more page per running request (decode pages later grow it as they come). When
the memory cannot be had (another process took what the budget was planned from), a request
that nothing running will make room for finishes with reason "memory" and no tokens (the
served app answers 503 kv_memory_unavailable); one that arrives while others run waits for
their pages. The failure is a fake (KVStore.grow raising MemoryError): a real allocation
failure cannot be caused on demand on a shared machine.
"""
import asyncio

import pytest

from engine import Engine
from engine.config import EngineConfig
from engine.kv import budget
from engine.kv.store import KVStore
from tests.engine_helpers import (PAGE_BYTES_LLAMA, collect, greq, prompt, run, started, tokens,
                                  wait_idle)

T = 16


def _failing_grow(self, num_pages):
    raise MemoryError("fake: the memory the budget was planned from is gone")


def _engines(tiny_llama, monkeypatch):
    cfg = EngineConfig(model=tiny_llama, kv_budget_bytes=64 * PAGE_BYTES_LLAMA, page_tokens=T,
                       max_step_tokens=64)
    whole = Engine(cfg)
    monkeypatch.setattr(budget, "FIRST_SLAB_BYTES", 0)   # the slab: one page per sequence (16)
    monkeypatch.setattr(KVStore, "grow", _failing_grow)
    return whole, Engine(cfg)


def test_a_request_the_slab_cannot_hold_is_turned_away_and_serving_goes_on(
        tiny_llama, monkeypatch):
    whole, stuck = _engines(tiny_llama, monkeypatch)
    try:
        assert stuck.kvstore.allocated_pages == 16 < stuck.kvstore.num_pages
        small = lambda rid: greq(rid, prompt(20, seed=1), max_tokens=12)  # noqa: E731
        want = tokens(run(collect(whole, small("w"))))
        assert tokens(run(collect(stuck, small("a")))) == want
        # A 300-token prompt needs 19 pages: more than the 16 the slab holds.
        big = run(collect(stuck, greq("big", prompt(300, seed=2), max_tokens=40)))
        assert [d.finish_reason for d in big] == ["memory"] and tokens(big) == []
        sched = stuck.scheduler
        assert sched.counters["kv_growth_failed"] >= 1
        assert "MemoryError" in sched.last_growth_error
        # Nothing leaked, nothing half-grown, and the engine still serves what fits.
        assert stuck.healthy() and stuck.kvstore.allocated_pages == 16
        assert tokens(run(collect(stuck, small("b")))) == want
        assert wait_idle(stuck).kv_pages_used == 0
        sched.pool.check_consistent()
    finally:
        whole.shutdown()
        stuck.shutdown()


def test_a_request_that_arrives_while_others_run_waits_for_their_pages(tiny_llama, monkeypatch):
    whole, stuck = _engines(tiny_llama, monkeypatch)
    try:
        want = tokens(run(collect(whole, greq("w", prompt(40, seed=3), max_tokens=30))))
        want_late = tokens(run(collect(whole, greq("wl", prompt(200, seed=4), max_tokens=40))))

        async def go():
            # One request holds 3 of the 16 pages (and may take one more); a second one whose
            # prefill needs 13 cannot be backed while it runs (17 > 16): it waits, and runs in
            # the slab (15 pages in all) once those pages return.
            agen, first = await started(stuck, greq("a", prompt(40, seed=3), max_tokens=30))
            late = asyncio.ensure_future(
                collect(stuck, greq("late", prompt(200, seed=4), max_tokens=40)))
            rest = [d async for d in agen]
            return first + rest, await late

        running, late = run(go())
        assert tokens(running) == want
        assert tokens(late) == want_late and late[-1].finish_reason == "length"
        assert stuck.scheduler.counters["kv_growth_failed"] >= 1   # it did wait
        assert stuck.scheduler.counters["finished_memory"] == 0
        assert wait_idle(stuck).kv_pages_used == 0
    finally:
        whole.shutdown()
        stuck.shutdown()


@pytest.mark.parametrize("compiled", [None, True])
def test_growth_at_admission_while_steps_are_in_flight_keeps_every_row(tiny_llama, monkeypatch,
                                                                       compiled):
    """The growth a late request's admission needs happens between pipelined decode steps of
    the requests already running (no fake here): every row generates what it would in a pool
    allocated whole."""
    cfg = EngineConfig(model=tiny_llama, kv_budget_bytes=64 * PAGE_BYTES_LLAMA, page_tokens=T,
                       max_step_tokens=64, compiled_decode=compiled)
    whole = Engine(cfg)
    monkeypatch.setattr(budget, "FIRST_SLAB_BYTES", 0)
    slab = Engine(cfg)
    first, late = greq("a", prompt(60, seed=5), max_tokens=60), greq("b", prompt(200, seed=6),
                                                                       max_tokens=60)

    async def go(eng):
        agen, head = await started(eng, first)
        grown_before = eng.kvstore.growths
        other = asyncio.ensure_future(collect(eng, late))
        rest = [d async for d in agen]
        return head + rest, await other, grown_before

    try:
        want_a, want_b, _ = run(go(whole))
        got_a, got_b, grown_before = run(go(slab))
        assert tokens(got_a) == tokens(want_a) and tokens(got_b) == tokens(want_b)
        assert grown_before == 0 and slab.kvstore.growths >= 1   # grew while "a" decoded
        assert wait_idle(slab).kv_pages_used == 0
        slab.scheduler.pool.check_consistent()
    finally:
        whole.shutdown()
        slab.shutdown()
