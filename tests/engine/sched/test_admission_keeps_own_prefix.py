"""A request that must wait for cached pages to be evicted keeps the prefix it found: the
scheduler evicts while the request still holds it. The cache evicts the page expected back last
(engine/kv/reuse.py), and a page just looked up would otherwise be that page: the request would
pay for its own room with its own history."""
from engine.kv.budget import ByteLedger, build_cost_model
from engine.kv.pages import PagePool
from engine.kv.prefix import PrefixCache, chain_root
from engine.sampling.params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.seq import Seq
from tests.scheduler_helpers import BPT, PAGE


def _scheduler(pages, clock):
    cm = build_cost_model(budget_bytes=pages * PAGE * BPT, bytes_per_token=BPT, page_tokens=PAGE,
                          fixed_bytes_per_request=0, max_num_seqs=4, token_limit=10_000)
    pool = PagePool(cm.budget_bytes // (PAGE * BPT), PAGE)
    return Scheduler(pool, ByteLedger(cm), max_num_seqs=4, max_step_tokens=64, max_waiting=8,
                     eos_ids={0}, prefix=PrefixCache(pool, clock=clock),
                     root_of=lambda s: chain_root("native", "fp", s.tenant, PAGE))


def _run(sch, rid, ids):
    s = Seq(rid, list(ids), SamplingParams(max_tokens=1), arrival=0.0)
    sch.submit(s, 0.0)
    while not sch.idle:
        step = sch.schedule(0.0)
        if step is None:
            sch.reclaim(10 ** 9)
            continue
        sch.complete(step, [7 if c.samples else None for c in step.chunks], 0.0)
        sch.reclaim(step.step_id)
    return s


def test_the_waiting_request_keeps_its_prefix_while_room_is_made():
    now = [0.0]
    sch = _scheduler(pages=5, clock=lambda: now[0])
    mine, other = [1] * 8, [2] * 8                  # two full pages each, cached when done
    _run(sch, "mine", mine)
    now[0] = 1.0
    _run(sch, "other", other)
    assert sch.pool.num_used == 4                   # the cache holds both; one page is free
    now[0] = 5.0   # the next turn: its prefix plus 7 tokens (+1 to generate) needs 2 more pages
    s = _run(sch, "next", mine + [3] * 7)
    assert s.cached_tokens == 8 and s.finish_reason == "length"
    assert sch.counters["prefix_evicted_pages"] >= 1     # room was made from the other chain
