"""Scheduler behaviour on real pages and a real byte ledger (no arrays involved)."""
import pytest

from engine.errors import DeadlineUnmeetable, EngineOverloaded, RequestTooLarge
from tests.scheduler_helpers import PAGE, make_scheduler, run_step, seq


def test_admission_reserves_whole_footprint_in_pages():
    sch = make_scheduler()
    sch.submit(seq("a", prompt_len=5, max_tokens=4), 0.0)   # 9 raw tokens -> 3 pages of 4
    step, _ = run_step(sch)
    s = sch.running[0]
    assert s.reserved_pages == 3
    assert sch.ledger.used_bytes == sch.ledger.cost_model.request_bytes(9)
    assert len(s.table.pages) == 2  # pages are taken lazily, within the reservation


def test_chunked_prefill_respects_step_token_budget():
    sch = make_scheduler(max_step_tokens=8)
    sch.submit(seq("a", prompt_len=20, max_tokens=2), 0.0)
    sizes = []
    while True:
        step, new = run_step(sch)
        if step is None:
            break
        sizes.append(sum(len(c.token_ids) for c in step.chunks))
    assert sizes == [8, 8, 4, 1]  # three prefill chunks (last one samples), then one decode
    assert sch.idle and sch.ledger.used_bytes == 0 and sch.pool.num_free == sch.pool.num_pages


def test_decode_rows_come_first_and_batch_across_lengths():
    sch = make_scheduler(max_step_tokens=8)
    sch.submit(seq("a", prompt_len=3, max_tokens=5), 0.0)
    run_step(sch)                                   # a prefilled, first token sampled
    sch.submit(seq("b", prompt_len=12, max_tokens=5), 0.0)
    step, _ = run_step(sch)
    assert [(c.seq.request_id, len(c.token_ids)) for c in step.chunks] == [("a", 1), ("b", 7)]
    step, _ = run_step(sch)
    assert [(c.seq.request_id, c.start) for c in step.chunks] == [("a", 4), ("b", 7)]


def test_a_short_prefill_is_not_held_behind_a_long_one():
    """A long prompt first, a short one behind it: the short one goes in the first step (its
    first token comes a step later, not after the whole long prefill), and the long one still
    gets at least half of every step."""
    sch = make_scheduler(pages=64, max_step_tokens=16)
    sch.submit(seq("long", prompt_len=60, max_tokens=2), 0.0)
    sch.submit(seq("short", prompt_len=5, max_tokens=2), 0.0)
    step, new = run_step(sch)
    assert [(c.seq.request_id, len(c.token_ids)) for c in step.chunks] == [("short", 5),
                                                                         ("long", 11)]
    assert [s.request_id for s, _ in new] == ["short"]
    # Shorts that would take more than half the budget wait: the long prompt keeps advancing.
    for i in range(3):
        sch.submit(seq(f"s{i}", prompt_len=7, max_tokens=2), 0.0)
    step, _ = run_step(sch)
    assert sum(len(c.token_ids) for c in step.chunks if c.seq.request_id == "long") >= 16 // 2 - 1


def test_request_larger_than_budget_is_refused_others_undisturbed():
    sch = make_scheduler(pages=8)
    sch.submit(seq("ok", prompt_len=4, max_tokens=4), 0.0)
    with pytest.raises(RequestTooLarge, match="at most 32") as e:
        sch.submit(seq("huge", prompt_len=30, max_tokens=10), 0.0)
    assert e.value.raw_tokens == 40 and e.value.max_raw_tokens == 8 * PAGE
    assert [s.request_id for s in sch.waiting] == ["ok"]
    assert sch.counters["refused_too_large"] == 1


def test_request_that_fits_later_waits_fcfs():
    sch = make_scheduler(pages=6)
    sch.submit(seq("a", prompt_len=10, max_tokens=6), 0.0)   # 4 pages
    sch.submit(seq("b", prompt_len=10, max_tokens=6), 0.0)   # must wait for a
    sch.submit(seq("c", prompt_len=1, max_tokens=3), 0.0)    # small, but behind b (FCFS)
    run_step(sch)
    assert [s.request_id for s in sch.running] == ["a"]
    assert [s.request_id for s in sch.waiting] == ["b", "c"]
    while sch.running and sch.running[0].request_id == "a":
        run_step(sch)
    run_step(sch)
    assert [s.request_id for s in sch.running] == ["b", "c"]


def test_queue_bound_refuses_with_overloaded():
    sch = make_scheduler(max_waiting=1)
    sch.submit(seq("a"), 0.0)
    with pytest.raises(EngineOverloaded):
        sch.submit(seq("b"), 0.0)


def test_cancel_waiting_mid_prefill_and_mid_decode_frees_everything():
    sch = make_scheduler(pages=12, max_step_tokens=4)
    sch.submit(seq("d", prompt_len=3, max_tokens=5), 0.0)     # 2 pages
    sch.submit(seq("p", prompt_len=20, max_tokens=4), 0.0)    # 6 pages
    sch.submit(seq("w", prompt_len=20, max_tokens=4), 0.0)    # does not fit next to them
    run_step(sch)
    run_step(sch)
    by_id = {s.request_id: s for s in sch.running}
    assert not by_id["d"].prefilling and 0 < by_id["p"].num_computed < 20
    assert [s.request_id for s in sch.waiting] == ["w"]
    for rid in ("w", "p", "d"):
        assert sch.cancel(rid) is not None
    assert sch.cancel("d") is None  # idempotent
    assert sch.schedule(0.0) is None
    sch.reclaim(10**9)
    assert sch.idle and sch.ledger.used_bytes == 0 and sch.pool.num_free == sch.pool.num_pages
    assert {s.finish_reason for s in sch.pop_finished()} == {"cancelled"}


def test_cancel_mid_decode_waits_for_the_step_to_retire():
    sch = make_scheduler()
    sch.submit(seq("a", prompt_len=3, max_tokens=8), 0.0)
    run_step(sch)
    step = sch.schedule(0.0)               # a decode step is in flight
    sch.cancel("a")
    assert sch.reclaim(step.step_id - 1) == []          # not retired yet: nothing returned
    assert sch.ledger.used_bytes > 0 and sch.pool.num_used > 0
    assert [s.request_id for s in sch.reclaim(step.step_id)] == ["a"]
    assert sch.ledger.used_bytes == 0 and sch.pool.num_used == 0


def test_eos_and_max_tokens_finish():
    sch = make_scheduler()
    sch.submit(seq("eos", max_tokens=9), 0.0)
    sch.submit(seq("len", max_tokens=2), 0.0)
    run_step(sch, token=5)
    _, new = run_step(sch, token=0)   # EOS for both; "len" also hits max_tokens at 2
    done = {s.request_id: s.finish_reason for s in sch.pop_finished()}
    assert done == {"eos": "stop", "len": "stop"}
    sch2 = make_scheduler()
    sch2.submit(seq("len", max_tokens=2), 0.0)
    run_step(sch2)
    run_step(sch2)
    assert [s.finish_reason for s in sch2.pop_finished()] == ["length"]


def test_deadline_expires_while_queued_and_refuses_on_forecast():
    sch = make_scheduler(pages=16)
    sch.submit(seq("big", prompt_len=32, max_tokens=32), 0.0)      # fills the budget
    sch.submit(seq("late", prompt_len=2, max_tokens=2, deadline=1.0), 0.0)
    run_step(sch, now=0.5)
    assert [s.request_id for s in sch.waiting] == ["late"]
    run_step(sch, now=1.0)
    assert [(s.request_id, s.finish_reason) for s in sch.pop_finished()] == [("late", "deadline")]
    with pytest.raises(DeadlineUnmeetable):
        sch.submit(seq("past", deadline=0.5), 1.0)
    sch.forecast.observe(prefill_tokens=100, decode_rows=0, seconds=1.0)   # 100 tok/s measured
    with pytest.raises(DeadlineUnmeetable) as e:
        sch.submit(seq("slow", prompt_len=50, deadline=1.2), 1.0)          # needs ~0.5 s
    assert e.value.forecast_s == pytest.approx(0.5)
    sch.submit(seq("fast", prompt_len=10, deadline=1.2), 1.0)              # needs ~0.1 s
    assert sch.counters["refused_deadline"] == 2
