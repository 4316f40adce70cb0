"""Random submit/cancel/step/finish/deadline/clock operations against the real scheduler, pages and
ledger: no leaks, no double frees (the pool raises on one), ledger back at zero when idle.

25 examples x at least 50 operations = 1,250+ operations per run.
"""
from hypothesis import HealthCheck, example, given, settings, strategies as st

from engine.errors import DeadlineUnmeetable, EngineOverloaded, RequestTooLarge
from engine.sched.seq import RUNNING
from tests.scheduler_helpers import make_scheduler, seq

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 40), st.integers(1, 24),
              st.one_of(st.none(), st.floats(0.0, 3.0))),
    st.tuples(st.just("cancel"), st.integers(0, 200)),
    st.tuples(st.just("step"), st.booleans(), st.booleans()),   # (sample EOS?, cancel in flight?)
    st.tuples(st.just("stop_string"), st.integers(0, 200)),
    st.tuples(st.just("clock"), st.floats(0.0, 1.0)),
)


def check_invariants(sch):
    sch.pool.check_consistent()
    holders = [*sch.running, *sch.unreclaimed]
    assert len({id(s) for s in holders}) == len(holders)
    assert not {id(s) for s in holders} & {id(s) for s in sch.waiting}
    assert sch.pool.num_used == sum(len(s.table.pages) for s in holders)
    cm = sch.ledger.cost_model
    assert sch.ledger.used_bytes == sum(cm.charge_bytes(s.raw_tokens) for s in holders)
    assert sch.ledger.used_bytes <= cm.budget_bytes
    assert all(len(s.table.pages) <= s.reserved_pages for s in holders)
    assert len(sch.running) <= sch.max_num_seqs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=50, max_size=90))
# The drain's last schedule() expires r1 mid-prefill with nothing left to run; r2 (waiting) fits
# only once r1's seat is reclaimed, and is admitted by the next schedule(), as in the engine loop.
@example(ops=[("submit", 1, 2, None), ("submit", 34, 3, 1.0), ("submit", 34, 23, None),
              ("step", False, False), ("stop_string", 0), ("clock", 1.0)])
def test_random_operations_never_leak(ops):
    sch = make_scheduler(pages=24, max_num_seqs=4, max_step_tokens=12, max_waiting=8)
    now, n, ids, retired = 0.0, 0, [], -1
    for o in ops:
        kind = o[0]
        if kind == "submit":
            _, plen, mtok, dl = o
            rid = f"r{n}"
            n += 1
            try:
                sch.submit(seq(rid, plen, mtok, deadline=None if dl is None else now + dl), now)
                ids.append(rid)
            except (RequestTooLarge, EngineOverloaded, DeadlineUnmeetable):
                pass
        elif kind == "cancel" and ids:
            sch.cancel(ids[o[1] % len(ids)])
        elif kind == "stop_string" and sch.running:
            sch.finish(sch.running[o[1] % len(sch.running)], "stop")
        elif kind == "clock":
            now += o[1]
        elif kind == "step":
            _, eos, cancel_in_flight = o
            step = sch.schedule(now)
            if step is not None:
                if cancel_in_flight:
                    victim = step.chunks[0].seq
                    sch.cancel(victim.request_id)
                    # The cancelled request's pages must outlive the in-flight step.
                    assert victim not in sch.reclaim(step.step_id - 1)
                    assert victim in sch.unreclaimed
                tokens = [(0 if eos else 5) if c.samples else None for c in step.chunks]
                sch.complete(step, tokens, now)
                retired = step.step_id
            sch.reclaim(retired)   # the loop reclaims after every (possibly empty) iteration
        check_invariants(sch)
        sch.pop_finished()
    # Drain as the engine loop does (engine/loop.py _serve): keep iterating while the scheduler is
    # not idle, reclaiming before and after every (possibly empty) schedule(). An empty schedule()
    # does not mean done: it may just have expired a request's deadline mid-prefill, its seat
    # frees at the next reclaim, and the engine polls and schedules again (admitting the head of
    # the queue). Empty schedules in a row, with every retired step reclaimed in between, mean a
    # request is stuck (waiting while nothing runs or holds memory): the loop stops and it fails.
    empty = 0
    for _ in range(10_000):
        if sch.idle:
            break
        sch.reclaim(retired)
        step = sch.schedule(now)
        if step is None:
            empty += 1
            if empty >= 3:
                break
        else:
            empty = 0
            sch.complete(step, [5 if c.samples else None for c in step.chunks], now)
            retired = step.step_id
        sch.reclaim(retired)
        check_invariants(sch)
    assert sch.idle, (f"stuck: waiting {[s.request_id for s in sch.waiting]}, running "
                      f"{[s.request_id for s in sch.running]}, unreclaimed "
                      f"{[s.request_id for s in sch.unreclaimed]}")
    assert sch.ledger.used_bytes == 0 and sch.ledger.running == 0
    assert sch.pool.num_free == sch.pool.num_pages
    assert all(s.status != RUNNING for s in sch.pop_finished())
