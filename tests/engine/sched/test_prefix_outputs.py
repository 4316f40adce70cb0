"""A finished request publishes the full pages of prompt + output into the prefix cache (at reclaim,
before its pages are released), so a chat's next turn, which resends the history, finds the reply
cached too: same tenant and chain, only pages whose K/V were written (the last sampled token has
none), evictable like prompt pages, never another tenant's."""
import pytest

from engine.kv.budget import ByteLedger, build_cost_model
from engine.kv.pages import PagePool
from engine.kv.prefix import PrefixCache, chain_root
from engine.sampling.params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.seq import Seq
from tests.engine_helpers import (PAGE_BYTES_LLAMA, collect, greq, make_engine, prompt, run,
                                  tokens, wait_stats)
from tests.engine_helpers import plain  # noqa: F401 - a fixture
from tests.scheduler_helpers import BPT, PAGE

# ---- scheduler level (no model) ---------------------------------------------------------------


def prefix_scheduler(pages=32, max_step_tokens=16):
    cm = build_cost_model(budget_bytes=pages * PAGE * BPT, bytes_per_token=BPT, page_tokens=PAGE,
                          fixed_bytes_per_request=0, max_num_seqs=4, token_limit=10_000)
    pool = PagePool(cm.budget_bytes // (PAGE * BPT), PAGE)
    return Scheduler(pool, ByteLedger(cm), max_num_seqs=4, max_step_tokens=max_step_tokens,
                     max_waiting=64, eos_ids={0}, prefix=PrefixCache(pool),
                     root_of=lambda s: chain_root("native", "fp", s.tenant, PAGE))


def mkseq(rid, ids, max_tokens, tenant="default"):
    return Seq(rid, list(ids), SamplingParams(max_tokens=max_tokens), arrival=0.0, tenant=tenant)


def drive(sch):
    """Run synchronous steps to idle; each sampling row gets the next of 10, 11, ..."""
    tokens_ = iter(range(10, 10_000))
    while not sch.idle:
        step = sch.schedule(0.0)
        if step is None:
            sch.reclaim(10 ** 9)
            continue
        sch.complete(step, [next(tokens_) if c.samples else None for c in step.chunks], 0.0)
        sch.reclaim(step.step_id)


def test_scheduler_publishes_written_prompt_and_output_pages():
    sch = prefix_scheduler()
    a = mkseq("a", range(1, 6), max_tokens=8)            # 5 + 8 tokens, 12 with K/V: 3 pages
    sch.submit(a, 0.0)
    drive(sch)
    assert a.finish_reason == "length" and a.num_computed == 12
    assert len(sch.prefix) == 3 and sch.counters["prefix_output_pages"] == 2
    assert sch.pool.num_used == 3 and sch.ledger.used_bytes == 3 * PAGE * BPT   # cache's charge
    history = a.prompt_ids + a.output_ids
    b = mkseq("b", history + [99], max_tokens=2)
    other = mkseq("c", history + [99], max_tokens=2, tenant="other")
    sch.submit(b, 0.0)
    sch.submit(other, 0.0)
    drive(sch)
    assert b.cached_tokens == 12 and other.cached_tokens == 0
    # Under pressure every cached page (prompt or output) goes, and nothing leaks.
    sch.evict_cache(sch.pool.num_pages)
    assert sch.pool.num_used == 0 and sch.ledger.used_bytes == 0 and len(sch.prefix) == 0


def test_pipelined_finish_publishes_only_written_tokens():
    sch = prefix_scheduler()
    a = mkseq("a", range(1, 8), max_tokens=20)           # 7 prompt tokens
    sch.submit(a, 0.0)
    step = sch.schedule(0.0)
    sch.complete(step, [10], 0.0)                        # prefill: K/V of 7, first token 10
    sch.reclaim(step.step_id)
    for tok in (11, 12, 13):                             # decode: writes 7..9, samples 11..13
        step = sch.schedule(0.0)
        sch.complete(step, [tok], 0.0)
        sch.reclaim(step.step_id)
    assert a.num_computed == 10
    step = sch.schedule(0.0)                             # writes token 13 at 10, samples EOS
    assert sch.can_continue_decode(step)
    nxt = sch.continue_decode(step, [0])                 # pipelined: writes EOS at 11
    sch.complete(step, [0], 0.0)
    assert a.finish_reason == "stop" and a.num_computed == 11
    assert sch.reclaim(step.step_id) == []               # its last step is still in flight
    assert len(sch.prefix) == 1                          # prompt page only so far
    sch.complete(nxt, [5], 0.0)                          # the finished row's token is dropped
    assert sch.reclaim(nxt.step_id) == [a]
    # 11 tokens have K/V (EOS's row was written, but not counted): 2 full pages, not 3.
    assert len(sch.prefix) == 2
    history = a.prompt_ids + a.output_ids                # 7 + 5 = 12 tokens
    b = mkseq("b", history + [1], max_tokens=1)
    sch.submit(b, 0.0)
    drive(sch)
    assert b.cached_tokens == 8
    sch.evict_cache(sch.pool.num_pages)
    assert sch.pool.num_used == 0 and sch.ledger.used_bytes == 0


def test_cancelled_mid_prefill_publishes_no_more_than_its_prompt_pages():
    sch = prefix_scheduler(max_step_tokens=8)
    a = mkseq("a", range(1, 21), max_tokens=8)           # 20-token prompt, 8 per step
    sch.submit(a, 0.0)
    step = sch.schedule(0.0)
    sch.complete(step, [None], 0.0)
    sch.reclaim(step.step_id)
    sch.cancel("a")
    sch.reclaim(step.step_id)
    assert len(sch.prefix) == 2 and sch.counters["prefix_output_pages"] == 0
    sch.evict_cache(sch.pool.num_pages)
    assert sch.pool.num_used == 0 and sch.ledger.used_bytes == 0


# ---- through the Engine (tiny llama, 16-token pages) ------------------------------------------


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_next_turn_hits_the_reply_pages(tiny_llama, plain, fmt):
    eng = make_engine(tiny_llama, pages=32, max_step_tokens=16, kv_format=fmt,
                      enable_prefix_caching=True, tenant="t1")
    ref = plain if fmt == "native" else make_engine(tiny_llama, pages=32, max_step_tokens=16,
                                                    kv_format=fmt)
    try:
        first = prompt(20, seed=41)
        turn1 = run(collect(eng, greq("turn1", first, max_tokens=30)))
        reply = tokens(turn1)
        assert len(reply) == 30
        # 20 + 30 tokens, 49 with K/V written: 3 full pages (1 of prompt, 2 reaching the reply).
        wait_stats(eng, num_requests_running=0, prefix_cache_pages=3)
        second = first + reply + prompt(7, seed=42)
        turn2 = run(collect(eng, greq("turn2", second, max_tokens=8)))
        assert turn2[-1].usage.cached_tokens == 48 and turn2[-1].usage.prompt_tokens == 57
        assert tokens(turn2) == tokens(run(collect(ref, greq("turn2-ref", second, max_tokens=8))))
        wait_stats(eng, num_requests_running=0)
        other = run(collect(eng, greq("other", second, max_tokens=8, tenant="t2")))
        assert other[-1].usage.cached_tokens == 0
        assert tokens(other) == tokens(turn2)
    finally:
        eng.shutdown()
        if ref is not plain:
            ref.shutdown()


def test_output_pages_are_evicted_under_pressure_and_never_leak(tiny_llama):
    # 8 pages (128 tokens): one turn caches 3 pages (prompt + reply); a 100-raw-token request
    # needs 7, so at least 2 cached pages must go.
    eng = make_engine(tiny_llama, pages=8, max_step_tokens=16, enable_prefix_caching=True)
    try:
        run(collect(eng, greq("turn1", prompt(20, seed=43), max_tokens=30)))
        s = wait_stats(eng, num_requests_running=0, prefix_cache_pages=3)
        assert s.kv_pages_used == 3 == s.prefix_cache_evictable_pages
        assert s.prefix_cache_bytes == 3 * PAGE_BYTES_LLAMA and s.kv_bytes_reserved == 0
        big = run(collect(eng, greq("big", prompt(90, seed=44), max_tokens=10)))
        assert big[-1].finish_reason == "length"
        s = wait_stats(eng, num_requests_running=0)
        assert s.prefix_evicted_pages_total >= 2
        assert s.prefix_cache_bytes == s.prefix_cache_pages * PAGE_BYTES_LLAMA
        assert s.kv_pages_used == s.prefix_cache_pages == s.prefix_cache_evictable_pages
        eng.evict_prefix_cache()
        s = wait_stats(eng, kv_pages_used=0, kv_bytes_reserved=0, prefix_cache_pages=0,
                     prefix_cache_bytes=0)
        assert s.kv_raw_tokens_reserved == 0 and s.kv_workspace_bytes == 0
    finally:
        eng.shutdown()
