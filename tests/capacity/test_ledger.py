"""Two-phase reservations: hand-computed headroom, de-duplication, known-full, stale reports, TTLs,
re-establishment from replica reports, idempotency."""
import pytest

from capacity.errors import CapacityRefused
from capacity.identity import ExecutionKey
from capacity.ledger import CANCELLED, COMMITTED, DROPPED, EXPIRED, HELD, RELEASED, Ledger, LedgerConfig
from capacity.protocol import ActiveRequest, CostModelWire, SlotReport

KEY = ExecutionKey.make("m", "M4|Max", None)


def slot(used=0, max_=1000, running=0, waiting=0, conc=4, bpt=0, active=(), complete=True, **kw):
    return SlotReport(model_id="m", state=kw.pop("state", "running"), raw_budget_used=used,
                      raw_budget_max=max_, num_running=running, num_waiting=waiting,
                      max_concurrency=conc, kv_bytes_per_token=bpt,
                      active=[ActiveRequest(request_id=r, raw_tokens=t) for r, t in active],
                      active_complete=complete, **kw)


def ledger_with(*slots, cap=4, now=0.0, cfg=None):
    led = Ledger(cfg)
    for i, s in enumerate(slots):
        assert led.accept_seq(f"r{i}", 1, 1)
        led.apply_slot(f"r{i}", "node", s, KEY, cap, now)
    return led


def room(led, rid="r0", now=0.0):
    return led.headroom(led.replica("m", rid), now)


def test_hold_debits_routing_and_public_feed_together():
    led = ledger_with(slot())
    assert (room(led).raw_tokens, room(led).requests) == (1000, 4)
    res, ranking = led.hold("m", 300, "a", now=0.0)
    assert res.state == HELD and ranking == ["r0"]
    h, feed = room(led), led.feed("m", 0.0)
    assert (h.raw_tokens, h.requests) == (700, 3)
    assert (feed.raw_tokens, feed.requests, feed.max_request) == (700, 3, 700)


def test_heartbeat_that_reflects_a_hold_is_not_counted_twice():
    led = ledger_with(slot())
    led.hold("m", 300, "a", 0.0)
    led.hold("m", 200, "b", 0.0)
    assert room(led).raw_tokens == 500
    # The replica admitted "a" only: used 300 reflects it; "b" (200) is the de-duplicated extra.
    assert led.accept_seq("r0", 1, 2)
    led.apply_slot("r0", "node", slot(used=300, running=1), KEY, 4, 0.0)
    h = room(led)
    assert (h.raw_tokens, h.requests) == (1000 - 300 - 200, 4 - 1 - 1)
    # Both admitted: used 500, running 2 -> extra 0.
    assert led.accept_seq("r0", 1, 3)
    led.apply_slot("r0", "node", slot(used=500, running=2), KEY, 4, 0.0)
    assert (room(led).raw_tokens, room(led).requests) == (500, 2)


def test_cap_below_reported_concurrency_limits_slots():
    led = ledger_with(slot(conc=8), cap=1)
    assert room(led).requests == 1
    led.hold("m", 10, "a", 0.0)
    with pytest.raises(CapacityRefused) as e:
        led.hold("m", 10, "b", 0.0)
    assert e.value.reason == "no_capacity"
    assert led.outstanding_raw() == 10                      # the refusal debited nothing


def test_known_full_slot_is_never_routed():
    led = ledger_with(slot(max_=0, bpt=6400))
    assert room(led).reason == "known_full" and room(led).max_request == 0
    with pytest.raises(CapacityRefused):
        led.hold("m", 1, "a", 0.0)
    assert led.outstanding_raw() == 0 and led.feed("m", 0.0).ready is False


def test_budget_derived_from_the_cost_model_when_not_reported():
    cm = CostModelWire(budget_bytes=10_000, bytes_per_token=10, page_tokens=16,
                       fixed_bytes_per_request=50, concurrency_ceiling=4,
                       workspace={"fixed": 1000, "per_token": 2, "per_request": 100})
    led = ledger_with(slot(max_=None, cost_model=cm))
    assert (room(led).raw_tokens, room(led).requests) == (659, 4)   # pricing: Projection(659, 4)
    assert ledger_with(slot(max_=None)).headroom(
        ledger_with(slot(max_=None)).replica("m", "r0"), 0.0).reason == "no_budget"


def test_stale_and_out_of_order_sequences_are_discarded():
    led = Ledger()
    assert led.accept_seq("r0", 5, 10)
    assert not led.accept_seq("r0", 5, 10)    # duplicate
    assert not led.accept_seq("r0", 5, 9)     # out of order
    assert not led.accept_seq("r0", 4, 99)    # an older incarnation
    assert led.accept_seq("r0", 5, 11)
    assert led.accept_seq("r0", 6, 0)         # restart: sequence starts over


def test_replica_restart_drops_its_committed_reservations_but_keeps_holds():
    led = ledger_with(slot())
    led.hold("m", 100, "a", 0.0)
    led.commit("a", "r0", 0.0)
    led.hold("m", 50, "b", 0.0)
    assert led.accept_seq("r0", 2, 1)         # new incarnation
    assert led.outcome("a") == DROPPED and led.outcome("b") == HELD
    assert led.outstanding_raw() == 50


def test_hold_ttl_and_commit_ttl():
    led = ledger_with(slot(), cfg=LedgerConfig(hold_ttl_s=30, commit_ttl_s=900, stale_after_s=1e9,
                                               evict_after_s=1e9))
    led.hold("m", 100, "a", 0.0)
    led.hold("m", 100, "b", 0.0)
    led.commit("b", "r0", 10.0)
    assert led.expire(29.9) == []
    assert [r.request_id for r in led.expire(30.0)] == ["a"]
    assert led.outcome("a") == EXPIRED and led.outcome("b") == COMMITTED
    assert [r.request_id for r in led.expire(910.0)] == ["b"]
    assert led.outstanding_raw() == 0 and led.debited_raw == led.refunded_raw == 200


def test_release_cancel_and_hold_are_idempotent():
    led = ledger_with(slot())
    r1, _ = led.hold("m", 100, "a", 0.0)
    r2, _ = led.hold("m", 100, "a", 0.0)
    assert r1 is r2 and led.outstanding_raw() == 100
    assert led.release("a") is not None
    assert led.release("a") is None and led.cancel("a") is None
    assert led.refunded_raw == 100 and led.outcome("a") == RELEASED
    with pytest.raises(CapacityRefused) as e:
        led.hold("m", 100, "a", 0.0)
    assert e.value.reason == "duplicate_request_id"
    led.hold("m", 10, "c", 0.0)
    assert led.cancel("c") is not None and led.outcome("c") == CANCELLED
    assert not led.commit("c", "r0", 0.0)                # a cancelled hold cannot come back


def test_a_request_whose_hold_was_lost_or_cancelled_may_hold_again():
    """Serve routes a request again when its replica dies: the same request id comes back.
    Its old hold was dropped with the replica, so this is a retry, not a duplicate."""
    led = ledger_with(slot(), slot())
    res, _ = led.hold("m", 100, "a", 0.0)
    lost = res.replica_id
    assert led.commit("a", lost, 0.0)
    led.retire([lost])
    assert led.outcome("a") == DROPPED and led.outstanding_raw() == 0
    again, ranking = led.hold("m", 100, "a", 0.0)
    assert again.replica_id != lost and lost not in ranking
    assert led.outstanding_raw() == 100
    # Serve's router cancels the hold of a request it re-routes: that one may hold again too.
    assert led.cancel("a") is not None and led.outcome("a") == CANCELLED
    led.hold("m", 100, "a", 0.0)
    assert led.release("a") is not None
    with pytest.raises(CapacityRefused) as e:       # finished: now a true duplicate
        led.hold("m", 100, "a", 0.0)
    assert e.value.reason == "duplicate_request_id"


def test_commit_moves_the_debit_to_the_replica_that_admitted():
    led = ledger_with(slot(), slot())
    first = led.hold("m", 400, "a", 0.0)[0].replica_id
    other = "r1" if first == "r0" else "r0"
    assert led.commit("a", other, 0.0)
    assert room(led, other).raw_tokens == 600 and room(led, first).raw_tokens == 1000
    assert not led.commit("a", "ghost", 0.0)


def test_reservations_are_re_established_from_replica_reports():
    led = ledger_with(slot(used=300, running=1, active=[("a", 300)]))
    assert led.outcome("a") == COMMITTED and led.outstanding_raw() == 300
    assert room(led).raw_tokens == 700                   # de-duplicated against used=300
    assert led.release("a") is not None
    # A heartbeat generated before the release still lists "a": no phantom comes back.
    assert led.accept_seq("r0", 1, 2)
    led.apply_slot("r0", "node", slot(used=300, running=1, active=[("a", 300)]), KEY, 4, 0.0)
    assert led.outstanding_raw() == 0


def test_a_lost_release_is_dropped_after_missing_from_complete_reports():
    led = ledger_with(slot())
    led.hold("m", 100, "a", 0.0)
    led.commit("a", "r0", 0.0)
    for seq, complete in ((2, False), (3, True)):
        assert led.accept_seq("r0", 1, seq)
        led.apply_slot("r0", "node", slot(complete=complete), KEY, 4, 0.0)
    assert led.outcome("a") == COMMITTED                 # truncated lists prove nothing; 1 miss
    assert led.accept_seq("r0", 1, 4)
    led.apply_slot("r0", "node", slot(), KEY, 4, 0.0)
    assert led.outcome("a") == DROPPED and led.outstanding_raw() == 0


def test_silent_replicas_go_stale_then_are_evicted_with_their_reservations():
    led = ledger_with(slot(), cfg=LedgerConfig(stale_after_s=15, evict_after_s=90, hold_ttl_s=1e9))
    led.hold("m", 100, "a", 0.0)
    assert room(led, now=15.1).reason == "stale"
    assert led.feed("m", 15.1).requests == 0
    led.expire(90.1)
    assert led.replicas("m") == [] and led.outcome("a") == DROPPED and led.outstanding_raw() == 0
    with pytest.raises(CapacityRefused) as e:
        led.hold("m", 1, "b", 91.0)
    assert e.value.reason == "unknown_model"


def test_request_larger_than_any_replica_allows_is_refused_without_retry():
    cm = CostModelWire(budget_bytes=10**9, bytes_per_token=1, page_tokens=16, token_limit=100)
    led = ledger_with(slot(max_=10_000, cost_model=cm))
    assert room(led).max_request == 100
    with pytest.raises(CapacityRefused) as e:
        led.hold("m", 101, "a", 0.0)
    assert e.value.reason == "request_too_large" and e.value.retry_after_s == 0.0


def test_ranking_is_a_bounded_plan_best_first():
    slots = [slot(conc=4 if i != 3 else 8) for i in range(6)]
    led = Ledger(LedgerConfig(ranking_size=3))
    for i, s in enumerate(slots):
        assert led.accept_seq(f"r{i}", 1, 1)
        led.apply_slot(f"r{i}", "node", s, KEY, 8, 0.0)
    res, ranking = led.hold("m", 10, "a", 0.0)
    assert len(ranking) == 3 and ranking[0] == res.replica_id == "r3"   # most free slots first


def test_an_expired_hold_whose_late_commit_arrives_settles_once():
    led = Ledger(LedgerConfig(hold_ttl_s=1.0))
    assert led.accept_seq("r0", 1, 1)
    led.apply_slot("r0", "node", slot(), KEY, 4, 0.0)
    led.hold("m", 100, "a", 0.0)
    assert [r.request_id for r in led.expire(2.0)] == ["a"]
    assert led.outcomes == {EXPIRED: 1}
    assert led.commit("a", "r0", 2.1, raw_tokens=100, model="m")   # it was admitted after all
    assert led.outcome("a") == COMMITTED and led.outstanding_raw() == 100
    assert led.release("a") is not None
    assert led.outcomes == {EXPIRED: 0, RELEASED: 1} and led.rebuilt == 0
