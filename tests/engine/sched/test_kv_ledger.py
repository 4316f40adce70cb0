"""Random operations on the scheduler with a prefix cache: every used page is charged exactly
once (to the request that allocated it, or to the cache after that request left), the ledger
never exceeds the budget, and everything returns to zero once the cache is evicted."""
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.errors import DeadlineUnmeetable, EngineOverloaded, RequestTooLarge
from engine.kv.prefix import PrefixCache
from engine.sampling.params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.seq import Seq
from tests.scheduler_helpers import make_scheduler

PREFIXES = [list(range(100, 112)), list(range(200, 209)), [5] * 8]

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(0, 9), st.integers(1, 12),
              st.sampled_from(["a", "b"])),
    st.tuples(st.just("step"), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 100)),
    st.tuples(st.just("evict"), st.integers(0, 6)),
)


def with_cache(sch: Scheduler) -> Scheduler:
    sch.prefix = PrefixCache(sch.pool)
    sch.root_of = lambda s: s.tenant.encode().ljust(32, b"\0")
    return sch


def check(sch):
    sch.pool.check_consistent()
    led = sch.ledger
    holders = [*sch.running, *sch.unreclaimed]
    charged_pages = sum(s.reserved_pages - s.shared_pages for s in holders) + led.cache_pages
    assert led.used_bytes == charged_pages * led.page_charge
    assert sch.pool.num_used <= charged_pages                  # no page in use goes unpaid
    assert led.used_bytes <= led.budget_bytes
    assert sch.evictable_pages <= led.cache_pages <= len(sch.prefix)
    assert led.raw_tokens_reserved == sum(s.raw_tokens for s in holders)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=40, max_size=80))
def test_shared_pages_are_charged_once_and_nothing_leaks(ops):
    sch = with_cache(make_scheduler(pages=20, max_num_seqs=3, max_step_tokens=8, max_waiting=6))
    n, ids, hits = 0, [], 0
    for o in ops:
        if o[0] == "submit":
            _, p, tail, mtok, tenant = o
            s = Seq(f"r{n}", PREFIXES[p] + list(range(1, tail + 2)),
                    SamplingParams(max_tokens=mtok, ignore_eos=True), arrival=0.0, tenant=tenant)
            n += 1
            try:
                sch.submit(s, 0.0)
                ids.append(s.request_id)
            except (RequestTooLarge, EngineOverloaded, DeadlineUnmeetable):
                pass
        elif o[0] == "step":
            step = sch.schedule(0.0)
            if step is not None:
                sch.complete(step, [7 if c.samples else None for c in step.chunks], 0.0)
                if o[1] and sch.running:
                    sch.finish(sch.running[0], "stop")
                sch.reclaim(step.step_id)
        elif o[0] == "cancel" and ids:
            sch.cancel(ids[o[1] % len(ids)])
            sch.reclaim(10**9)
        elif o[0] == "evict":
            sch.evict_cache(o[1])
        hits = max(hits, sch.counters["prefix_hits"])
        check(sch)
    for s in [*sch.waiting, *sch.running]:
        sch.cancel(s.request_id)
    sch.reclaim(10**9)
    check(sch)
    sch.evict_cache(sch.pool.num_pages)
    assert sch.pool.num_used == 0 and sch.ledger.used_bytes == 0 and len(sch.prefix) == 0
    assert sch.ledger.cache_pages == 0


def test_a_hit_is_not_charged_for_its_shared_pages():
    sch = with_cache(make_scheduler(pages=8, max_num_seqs=2, max_step_tokens=16))
    first = Seq("a", PREFIXES[0] + [1], SamplingParams(max_tokens=2, ignore_eos=True))
    sch.submit(first, 0.0)
    while sch.running or sch.waiting or sch.unreclaimed:
        step = sch.schedule(0.0)
        sch.complete(step, [7 if c.samples else None for c in step.chunks], 0.0)
        sch.reclaim(step.step_id)
    page = sch.ledger.page_charge
    assert sch.ledger.used_bytes == 3 * page and len(sch.prefix) == 3   # 12 prompt tokens
    second = Seq("b", PREFIXES[0] + [2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    sch.submit(second, 0.0)
    sch.schedule(0.0)
    assert second.cached_tokens == 12 and second.num_computed == 12
    assert sch.ledger.held("b") == (4 - 3) * page            # 16 raw tokens = 4 pages, 3 shared
    assert sch.ledger.raw_tokens_reserved == 16


def test_only_cache_only_pages_are_evictable():
    sch = with_cache(make_scheduler(pages=8, max_num_seqs=2, max_step_tokens=16))
    a = Seq("a", PREFIXES[0] + [1], SamplingParams(max_tokens=2, ignore_eos=True))
    sch.submit(a, 0.0)
    step = sch.schedule(0.0)
    sch.complete(step, [7], 0.0)                 # prefill retired: 3 prompt pages cached
    assert len(sch.prefix) == 3 and sch.evictable_pages == 0   # a still holds them
    sch.cancel("a")
    sch.reclaim(step.step_id)
    assert sch.evictable_pages == 3 == sch.ledger.cache_pages
    assert sch.evict_cache(10) == 3 and sch.ledger.used_bytes == 0


def test_prompt_pages_are_shared_chunk_by_chunk_while_prefill_runs():
    # 4-token steps: the 13-token prompt takes four prefill chunks. After the first chunk retires,
    # its page is already in the cache and a second request with the same prompt shares it.
    sch = with_cache(make_scheduler(pages=12, max_num_seqs=2, max_step_tokens=4))
    a = Seq("a", PREFIXES[0] + [1], SamplingParams(max_tokens=2, ignore_eos=True))
    sch.submit(a, 0.0)
    step = sch.schedule(0.0)
    assert [len(c.token_ids) for c in step.chunks] == [4] and not step.chunks[0].samples
    sch.complete(step, [None], 0.0)
    sch.reclaim(step.step_id)
    assert len(sch.prefix) == 1 and a.num_computed == 4
    b = Seq("b", PREFIXES[0] + [2], SamplingParams(max_tokens=2, ignore_eos=True))
    sch.submit(b, 0.0)
    sch.schedule(0.0)
    assert b.cached_tokens == 4 and b.shared_pages == 1
    assert b.table.pages[0] == a.table.pages[0]
