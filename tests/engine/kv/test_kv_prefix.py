"""Prefix reuse through the Engine: hits skip the cached full pages (usage.cached_tokens), the
output is the same as without reuse, shared pages are charged once, tenants and formats never
share, and the cache gives every page and byte back when evicted."""
import asyncio

import pytest

from engine.kv.prefix import chain_root
from tests.engine_helpers import (PAGE_BYTES_LLAMA, collect, greq, make_engine, prompt, run,
                                  tokens, wait_stats)
from tests.engine_helpers import plain  # noqa: F401 - a fixture

SHARED = prompt(32, seed=7)                    # two full 16-token pages


class Trace:
    def __init__(self):
        self.events = []

    def __call__(self, event, **f):
        self.events.append((event, f))

    def admit(self, rid):
        return next(f for e, f in self.events if e == "admit" and f["request"] == rid)


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_hit_skips_cached_pages_and_generates_the_same_tokens(tiny_llama, plain, fmt):
    trace = Trace()
    eng = make_engine(tiny_llama, pages=32, max_step_tokens=16, kv_format=fmt,
                      enable_prefix_caching=True, trace=trace)
    ref = plain if fmt == "native" else make_engine(tiny_llama, pages=32, max_step_tokens=16,
                                                    kv_format=fmt)
    try:
        first, second = SHARED + prompt(9, seed=1), SHARED + prompt(5, seed=2)
        miss = run(collect(eng, greq("x", first)))
        assert miss[-1].usage.cached_tokens == 0
        s = wait_stats(eng, num_requests_running=0, prefix_cache_pages=2)
        page_bytes = s.kv_bytes_total // s.kv_pages_total
        # Idle: only the cache holds pages, charged to it, but evictable: not reserved for routing.
        assert s.kv_pages_used == 2 and s.prefix_cache_bytes == 2 * page_bytes
        assert s.prefix_cache_evictable_pages == 2 and s.kv_bytes_reserved == 0
        hit = run(collect(eng, greq("y", second)))
        assert hit[-1].usage.cached_tokens == 32 and hit[-1].usage.prompt_tokens == 37
        assert tokens(hit) == tokens(run(collect(ref, greq("y-ref", second))))
        assert tokens(miss) == tokens(run(collect(ref, greq("x-ref", first))))
        # The hit paid for its own pages only; the raw-token budget still saw all of them.
        cm = eng.cost_model()
        assert trace.admit("y")["charged"] == cm.charge_bytes(37 + 6) - 2 * page_bytes
        assert trace.admit("x")["charged"] == cm.charge_bytes(41 + 6)
        s = wait_stats(eng, num_requests_running=0)
        assert s.prefix_hits_total == 1 and s.prefix_hit_tokens_total == 32
        assert s.prompt_tokens_total == 41 + 37 - 32           # the hit computed 5 tokens
    finally:
        eng.shutdown()
        if ref is not plain:
            ref.shutdown()


def test_tenants_and_formats_never_share(tiny_llama):
    eng = make_engine(tiny_llama, pages=32, max_step_tokens=16, enable_prefix_caching=True,
                      tenant="t1")
    other = make_engine(tiny_llama, pages=32, max_step_tokens=16, enable_prefix_caching=True,
                        tenant="t1", kv_format="int4")
    try:
        ids = SHARED + [5, 6, 7]
        assert run(collect(eng, greq("a", ids)))[-1].usage.cached_tokens == 0
        wait_stats(eng, num_requests_running=0)
        assert run(collect(eng, greq("b", ids, tenant="t2")))[-1].usage.cached_tokens == 0
        wait_stats(eng, num_requests_running=0)
        assert run(collect(eng, greq("c", ids)))[-1].usage.cached_tokens == 32      # t1 again
        assert run(collect(eng, greq("d", ids, tenant="t2")))[-1].usage.cached_tokens == 32
        # Another format is another storage identity, hence another chain root.
        s_native, s_int4 = eng.stats(), other.stats()
        assert s_native.storage_identity != s_int4.storage_identity
        fp = eng.loaded.fingerprint
        assert (chain_root(s_native.storage_identity, fp, "t1", 16)
                != chain_root(s_int4.storage_identity, fp, "t1", 16))
        assert run(collect(other, greq("e", ids)))[-1].usage.cached_tokens == 0
    finally:
        eng.shutdown()
        other.shutdown()


def test_short_of_pages_evicts_and_nothing_leaks(tiny_llama):
    # 8 pages (128 tokens): three cached prompts fill 6 pages; a 100-raw-token request needs 7.
    eng = make_engine(tiny_llama, pages=8, max_step_tokens=16, enable_prefix_caching=True)
    try:
        for i in range(3):
            run(collect(eng, greq(f"fill{i}", prompt(33, seed=20 + i), max_tokens=2)))
        s = wait_stats(eng, num_requests_running=0, prefix_cache_pages=6)
        assert s.prefix_cache_bytes == 6 * PAGE_BYTES_LLAMA and s.kv_bytes_reserved == 0
        big = run(collect(eng, greq("big", prompt(90, seed=30), max_tokens=10)))
        assert big[-1].finish_reason == "length"
        s = wait_stats(eng, num_requests_running=0)
        assert s.prefix_evicted_pages_total >= 5
        assert s.prefix_cache_bytes == s.prefix_cache_pages * PAGE_BYTES_LLAMA
        assert s.kv_pages_used == s.prefix_cache_pages == s.prefix_cache_evictable_pages

        async def concurrent():   # two requests sharing cached pages at once
            ids = prompt(90, seed=30)
            return await asyncio.gather(collect(eng, greq("s1", ids[:40], 3)),
                                        collect(eng, greq("s2", ids[:40] + [9], 3)))
        a, b = run(concurrent())
        assert a[-1].usage.cached_tokens + b[-1].usage.cached_tokens >= 32
        wait_stats(eng, num_requests_running=0)
        eng.evict_prefix_cache()
        s = wait_stats(eng, kv_pages_used=0, kv_bytes_reserved=0, prefix_cache_pages=0,
                     prefix_cache_bytes=0)
        assert s.kv_raw_tokens_reserved == 0 and s.kv_workspace_bytes == 0
    finally:
        eng.shutdown()
