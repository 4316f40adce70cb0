"""A KV pool that grows (issue 34 item 1): a replica allocates one slab of its KV pool at start
and the rest as admitted work needs it, with admission and capacity numbers unchanged.

The page pool's counts are the whole pool's from the start; ids past the allocated ones are
backed (by the store's `grow`) before they are handed out; growth keeps every page's rows in
every store format; and an engine that starts with a small slab generates exactly the tokens of
one whose pool was allocated whole, growing as its requests need pages.
"""
import asyncio

import mlx.core as mx
import numpy as np
import pytest

from engine.config import EngineConfig
from engine import Engine
from engine.errors import PageError
from engine.kv import budget
from engine.kv.factory import store_factory
from engine.kv.pages import GrowthFailed, PagePool, PageTable, grow_target
from engine.kv.store import KVStore
from engine.model.loader import load_model
from tests.engine_helpers import PAGE_BYTES_LLAMA, collect, greq, prompt, run, tokens, wait_idle

T = 16


def test_pool_counts_are_the_whole_pools_and_grows_before_handing_out_ids():
    grown_to = []
    pool = PagePool(16, T, allocated=2, grow=grown_to.append)
    assert (pool.num_free, pool.num_used, pool.allocated) == (16, 0, 2)
    a = pool.allocate(2)
    assert grown_to == [] and sorted(a) == [0, 1]
    b = pool.allocate(1)                    # past the slab: doubles first
    assert grown_to == [4] and b == [2] and pool.allocated == 4
    c = pool.allocate(7)                    # needs 3 + 7 > 4: grows to what is missing at least
    assert grown_to == [4, 10] and pool.allocated == 10 and len(set(a + b + c)) == 10
    assert (pool.num_free, pool.num_used) == (6, 10)
    pool.free(a)
    pool.check_consistent()
    d = pool.allocate(8)                    # 2 freed + 6 new: capped at the id space
    assert grown_to == [4, 10, 16] and pool.allocated == 16 and d[:2] == a
    with pytest.raises(PageError, match="out of pages"):
        pool.allocate(1)
    assert grown_to == [4, 10, 16]
    pool.check_consistent()


def test_a_growth_that_fails_leaves_the_pool_as_it_was():
    def no_memory(n):
        raise MemoryError(f"no memory for {n} pages")
    pool = PagePool(8, T, allocated=2, grow=no_memory)
    held = pool.allocate(2)
    with pytest.raises(GrowthFailed, match="from 2 to 4 pages") as failed:
        pool.allocate(1)
    assert isinstance(failed.value.__cause__, MemoryError)   # what the store raised, kept
    assert (pool.allocated, pool.num_free, pool.num_used) == (2, 6, 2)
    with pytest.raises(PageError, match="unknown page id"):
        pool.refcount(2)                    # never handed out
    pool.free(held)
    pool.check_consistent()


def test_a_pool_short_of_its_id_space_needs_a_way_to_grow():
    with pytest.raises(PageError, match="no way to grow"):
        PagePool(8, T, allocated=2)
    assert PagePool(8, T).allocated == 8   # the default: allocated whole, as before
    assert grow_target(3, 1, 100) == 6 and grow_target(3, 10, 100) == 13
    assert grow_target(60, 1, 100) == 100


def test_first_slab_is_small_and_never_past_the_pool():
    page = 2_949_120   # one 64-token page of SmolLM2 in float32 (30 layers x 3 heads x 64 x 2 x 4)
    assert budget.first_slab_pages(4096, page, 32) == budget.FIRST_SLAB_BYTES // page
    assert budget.first_slab_pages(50, page, 32) == 50
    assert budget.first_slab_pages(4096, 1 << 30, 32) == 32   # one page per running sequence


@pytest.fixture(scope="module")
def loaded(tiny_model_dirs):
    return load_model(tiny_model_dirs["gpt_oss"])   # packed full layer + native sliding layer


@pytest.mark.parametrize("fmt", ["native", "int8", "int4-sink", "int4-tail", "int4-kivi"])
def test_growth_keeps_every_page_and_zeroes_the_new_ones(loaded, fmt):
    make = store_factory(fmt, tail_slots=4)
    store = KVStore(loaded.geometry, 12, T, loaded.dtype, layer_factory=make, initial_pages=3)
    pool = PagePool(12, T, allocated=3, grow=store.grow, on_free=store.release_pages)
    page_bytes = store.page_bytes
    rng = np.random.default_rng(0)
    table = PageTable(pool)
    table.ensure(3 * T - 5)                  # a partial last page: a native tail where kept
    slots = np.array([table.slot(i) for i in range(3 * T - 5)])
    for index, layer in store.layers.items():
        lg = loaded.geometry.layers[index]
        k = mx.array(rng.standard_normal((len(slots), lg.kv_heads, lg.head_dim)), loaded.dtype)
        v = mx.array(rng.standard_normal((len(slots), lg.kv_heads, lg.v_head_dim)), loaded.dtype)
        store.write(index, slots, k, v)
    mx.eval(store.arrays())
    pages = np.array([table.pages])
    before = {i: store.gather(i, pages) for i in store.layers}
    nbytes = store.nbytes
    more = PageTable(pool)
    more.ensure(5 * T)                       # past the slab: the store grows
    assert store.allocated_pages == pool.allocated == 8 and store.growths == 1
    assert store.page_bytes == page_bytes and store.nbytes > nbytes
    for i, (k, v) in before.items():
        k2, v2 = store.gather(i, pages)
        assert mx.array_equal(k, k2).item() and mx.array_equal(v, v2).item(), (fmt, i)
        kn, vn = store.gather(i, np.array([more.pages[-2:]]))
        assert not mx.any(kn).item() and not mx.any(vn).item()


async def _run_all(eng, reqs):
    return await asyncio.gather(*(collect(eng, r) for r in reqs))


@pytest.mark.parametrize("fmt,compiled", [("native", None), ("int8", None),
                                          ("int4-tail", None), ("native", True)])
def test_an_engine_started_with_a_small_slab_generates_what_a_whole_pool_does(
        tiny_llama, monkeypatch, fmt, compiled):
    """Same greedy tokens, batched and alone, from an engine whose pool grows while requests
    run (a pipelined decode step in flight included) and one allocated whole; admission and
    the advertised capacity are the same; nothing leaks."""
    cfg = dict(model=tiny_llama, kv_format=fmt, kv_budget_bytes=64 * PAGE_BYTES_LLAMA,
               page_tokens=T, max_step_tokens=64, compiled_decode=compiled)
    whole = Engine(EngineConfig(**cfg))
    monkeypatch.setattr(budget, "FIRST_SLAB_BYTES", 0)   # the slab: one page per sequence (16)
    slab = Engine(EngineConfig(**cfg))
    try:
        reqs = lambda: [greq(f"r{i}", prompt(20 + 17 * i, seed=i), max_tokens=40)  # noqa: E731
                        for i in range(4)]
        want = [tokens(d) for d in run(_run_all(whole, reqs()))]
        got = [tokens(d) for d in run(_run_all(slab, reqs()))]
        assert got == want and all(len(t) == 40 for t in want)
        grown, full = slab.kvstore, whole.kvstore
        assert full.growths == 0 and full.allocated_pages == full.num_pages
        assert grown.growths >= 1 and 16 < grown.allocated_pages < grown.num_pages
        assert grown.num_pages == full.num_pages
        if compiled:   # compiled decode steps ran (growth now happens at admission,
            # before the first decode of these four: no extra trace is needed for it)
            assert slab._parts.runner.compiled.traces >= whole._parts.runner.compiled.traces > 0
        assert slab.cost_model() == whole.cost_model()
        s, w = wait_idle(slab), wait_idle(whole)
        assert (s.kv_pages_total, s.kv_pages_used) == (w.kv_pages_total, 0)
        slab.scheduler.pool.check_consistent()
        again = lambda: greq("again", prompt(150, seed=9), max_tokens=40)  # noqa: E731
        assert (tokens(run(collect(slab, again()))) == tokens(run(collect(whole, again()))))
    finally:
        whole.shutdown()
        slab.shutdown()
