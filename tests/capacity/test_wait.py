"""Waiting holds (capacity/waiting.py) through the actor's own batch path (capacity/ops.py), without
Ray: FIFO grants, timeout -> the usual refusal, cancel while waiting, grant on a heartbeat that
raises headroom, no overtaking, and other ops never delayed by a waiter. Plus the ledger's
conservation invariants under random interleavings with waiters (hypothesis)."""
import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from capacity.fleet import Fleet, FleetConfig
from capacity.ops import BatchOps

RETRY = 0.7


def beat(seq, max_=1000, used=0, model="m", replica="r0", active=()):
    return {"replica_id": replica, "node_id": replica, "chip_class": "M4|Max", "incarnation": 1,
            "seq": seq, "slots": [{
                "model_id": model, "state": "running", "raw_budget_used": used,
                "raw_budget_max": max_, "num_running": len(active), "max_concurrency": 64,
                "kv_bytes_per_token": 1,
                "active": [{"request_id": r, "raw_tokens": t} for r, t in active]}]}


def service() -> BatchOps:
    fleet = Fleet(FleetConfig.from_dict({"caps": {"native_seeds": {"m": 400.0, "m2": 400.0}},
                                         "ledger": {"retry_after_s": RETRY}}))
    ops = BatchOps(fleet)
    ops.apply([("heartbeat", beat(1)), ("heartbeat", beat(1, model="m2", replica="r2"))])
    return ops


def hold(ops, rid, raw, wait_s=0.0, model="m", owner=None):
    return ops.apply([("hold", model, raw, rid, None, (), wait_s)], owner)[0]


def outstanding(ops) -> int:
    led = ops.fleet.ledger
    assert led.debited_raw - led.refunded_raw == led.outstanding_raw()
    return led.outstanding_raw()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_waiters_are_granted_in_arrival_order():
    async def scenario():
        ops = service()
        assert hold(ops, "a", 1000)["ok"]
        futs = {rid: hold(ops, rid, 600, wait_s=10) for rid in ("b", "c", "d")}
        assert all(isinstance(f, asyncio.Future) and not f.done() for f in futs.values())
        assert ops.waits.waiting("m") == ["b", "c", "d"]
        assert outstanding(ops) == 1000                    # waiters debit nothing
        assert ops.apply([("release", "a", None)]) == [True]
        assert futs["b"].done() and not futs["c"].done()   # 600 + 600 > 1000: only the head
        b = futs["b"].result()
        assert b["ok"] and b["hold"].replica_id == "r0" and outstanding(ops) == 600
        ops.apply([("release", "b", None)])
        assert futs["c"].result()["ok"] and not futs["d"].done()
        ops.apply([("cancel", "c")])
        assert futs["d"].result()["ok"] and ops.waits.stats.granted == 3
        assert len(ops.waits) == 0 and outstanding(ops) == 600

    run(scenario())


def test_wait_runs_out_with_the_usual_refusal():
    async def scenario():
        ops = service()
        assert hold(ops, "a", 1000)["ok"]
        refusals = ops.fleet.counters["refusals"]
        fut = hold(ops, "b", 10, wait_s=0.05)
        out = await fut
        assert out == {**out, "ok": False, "reason": "no_capacity", "retry_after_s": RETRY}
        assert ops.fleet.counters["refusals"] == refusals + 1   # one refusal, not one per retry
        assert len(ops.waits) == 0 and ops.waits.stats.timed_out == 1
        ops.apply([("release", "a", None)])
        assert ops.fleet.ledger.reservation("b") is None      # never granted after giving up
        # wait_s = 0 is today's behaviour: refused at once.
        assert hold(ops, "a2", 1000)["ok"]
        assert hold(ops, "c", 10) == {"ok": False, "reason": "no_capacity",
                                      "retry_after_s": RETRY, "detail": "m"}

    run(scenario())


def test_cancel_while_waiting_is_never_granted():
    async def scenario():
        ops = service()
        assert hold(ops, "a", 1000)["ok"]
        b, c = hold(ops, "b", 500, wait_s=10), hold(ops, "c", 500, wait_s=10)
        assert ops.apply([("cancel", "b")]) == [True]
        assert (await b)["reason"] == "cancelled"
        ops.apply([("release", "a", None)])
        assert (await c)["ok"] and ops.fleet.ledger.reservation("b") is None
        # A cancel that overtook its waiting hold (another path) refuses that hold when it comes.
        assert ops.apply([("cancel", "late")]) == [False]
        assert hold(ops, "late", 10, wait_s=10)["reason"] == "cancelled"
        # The awaiting side cancelled its future (e.g. a Ray call cancelled): never granted.
        ops.apply([("hold", "m", 500, "fill", None, ())])
        d = hold(ops, "d", 500, wait_s=10)
        d.cancel()
        ops.apply([("release", "c", None)])
        assert ops.fleet.ledger.reservation("d") is None and len(ops.waits) == 0

    run(scenario())


def test_heartbeat_that_raises_headroom_grants_waiters():
    async def scenario():
        ops = service()
        assert hold(ops, "a", 1000)["ok"]
        fut = hold(ops, "b", 500, wait_s=10)
        ops.apply([("heartbeat", beat(2, max_=1000, used=1000, active=[("a", 1000)]))])
        assert not fut.done()
        ops.apply([("heartbeat", beat(3, max_=2000, used=1000, active=[("a", 1000)]))])
        assert (await fut)["ok"] and outstanding(ops) == 1500

    run(scenario())


def test_no_overtaking_and_other_ops_are_not_delayed():
    async def scenario():
        ops = service()
        assert hold(ops, "a", 800)["ok"]
        b = hold(ops, "b", 500, wait_s=10)
        # 200 tokens are free, but "b" came first: a newcomer neither waits past it nor jumps it.
        small = hold(ops, "small", 100)
        assert small["reason"] == "no_capacity" and "waiting ahead" in small["detail"]
        later = hold(ops, "later", 100, wait_s=10)
        assert ops.waits.waiting("m") == ["b", "later"]
        # One batch: a waiting hold next to other ops. Those are applied now, in order.
        out = ops.apply([("hold", "m", 500, "e", None, (), 10.0), ("hold", "m2", 10, "x", None, ()),
                         ("commit", "x", "r2"), ("release", "x", None)])
        assert isinstance(out[0], asyncio.Future) and out[1]["ok"] and out[2] is True and out[3] is True
        assert ops.fleet.ledger.outcome("x") == "released"
        ops.apply([("release", "a", None)])
        assert (await b)["ok"] and (await later)["ok"] and not out[0].done()
        assert ops.waits.waiting("m") == ["e"]
        ops.apply([("cancel", "e")])
        assert (await out[0])["reason"] == "cancelled"
        # Refusals no wait can cure are answered at once, even behind a queue.
        ops.apply([("hold", "m", 400, "f", None, ())])
        g = hold(ops, "g", 800, wait_s=10)
        assert hold(ops, "a", 10, wait_s=10)["reason"] == "duplicate_request_id"
        assert hold(ops, "h", 10, wait_s=10, model="nope")["reason"] == "unknown_model"
        assert not g.done()

    run(scenario())


def test_a_resent_waiting_hold_keeps_its_place_and_owner_loss_drops_it():
    async def scenario():
        ops = service()
        assert hold(ops, "a", 1000)["ok"]
        conn1, conn2 = object(), object()
        b = hold(ops, "b", 500, wait_s=10, owner=conn1)
        c = hold(ops, "c", 500, wait_s=10, owner=conn2)
        assert hold(ops, "b", 500, wait_s=10, owner=None) is b    # resent through Ray
        ops.waits.drop_owner(conn1)                                 # b's new owner is None: kept
        ops.waits.drop_owner(conn2)
        assert (await c)["reason"] == "cancelled" and ops.waits.waiting("m") == ["b"]
        ops.apply([("release", "a", None)])
        assert (await b)["ok"]

    run(scenario())


def other_step(ops, kind, rid, seq, raw, replica="r0") -> int:
    """A property test's step that is not a hold: a release, a cancel (never left waiting) or a
    heartbeat of budget 2 x raw from `replica`; returns the heartbeat sequence number."""
    if kind == "release":
        ops.apply([("release", rid, None)])
    elif kind == "cancel":
        ops.apply([("cancel", rid)])
        assert rid not in ops.waits.waiting()
    else:
        seq += 1
        ops.apply([("heartbeat", beat(seq, max_=raw * 2, replica=replica))])
    return seq


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "wait", "release", "cancel", "beat"]),
                          st.integers(0, 7), st.integers(100, 700)), max_size=40))
def test_waiters_keep_the_ledger_invariants(steps):
    async def scenario():
        ops = service()
        seq = 1
        parked: list[asyncio.Future] = []          # in arrival order
        granted: list[asyncio.Future] = []         # in grant order
        for kind, i, raw in steps:
            rid = f"q{i}"
            if kind in ("hold", "wait"):
                out = hold(ops, rid, raw, wait_s=30 if kind == "wait" else 0)
                if isinstance(out, asyncio.Future) and out not in parked:
                    parked.append(out)
                    out.add_done_callback(
                        lambda f: not f.cancelled() and f.result()["ok"] and granted.append(f))
            else:
                seq = other_step(ops, kind, rid, seq, raw)
            outstanding(ops)
            for rid_w in ops.waits.waiting():
                assert ops.fleet.ledger.reservation(rid_w) is None   # waiting debits nothing
            queue = ops.waits.waiting("m")
            assert len(queue) == len(set(queue))
        # Grants happen in arrival order among the waiters that were granted.
        assert granted == [f for f in parked if f in granted]
        for fut in parked:
            fut.cancel()

    run(scenario())


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def capped_service(clock=None, ttft_objective_s=2.0) -> BatchOps:
    """One replica whose learned cap is 3 (seed 20 tok/s, k 0.39, floor min(15, 20/2)) under a
    ceiling of 64 and ample memory."""
    fleet = Fleet(FleetConfig.from_dict({"caps": {"native_seeds": {"m": 20.0},
                                                  "ttft_objective_s": ttft_objective_s}}))
    ops = BatchOps(fleet, clock) if clock else BatchOps(fleet)
    ops.apply([("heartbeat", beat(1))])
    return ops


def test_a_request_queued_half_the_ttft_objective_is_admitted_above_the_cap():
    async def scenario():
        clock = FakeClock()
        ops = capped_service(clock)
        assert [hold(ops, r, 10)["ok"] for r in "abc"] == [True] * 3
        assert hold(ops, "d", 10)["reason"] == "no_capacity"     # at the cap: no wait, no entry
        fut = hold(ops, "e", 10, wait_s=30)
        clock.now += 0.9                                         # < 1 s: the cap still holds
        ops.apply([("heartbeat", beat(2, active=[(r, 10) for r in "abc"]))])
        assert not fut.done()
        clock.now += 0.2                                         # waited 1.1 s > 2 s / 2
        ops.apply([("heartbeat", beat(3, active=[(r, 10) for r in "abc"]))])
        assert fut.done() and fut.result()["ok"] and ops.waits.stats.stretched == 1
        assert outstanding(ops) == 40

    run(scenario())


def test_the_stretch_happens_on_its_own_timer_and_can_be_switched_off():
    async def scenario():
        ops = capped_service(ttft_objective_s=0.2)
        assert [hold(ops, r, 10)["ok"] for r in "abc"] == [True] * 3
        out = await hold(ops, "d", 10, wait_s=30)      # nothing else happens: the timer drains
        assert out["ok"] and ops.waits.stats.stretched == 1
        off = capped_service(ttft_objective_s=None)
        assert [hold(off, r, 10)["ok"] for r in "abc"] == [True] * 3
        out = await hold(off, "d", 10, wait_s=0.3)
        assert out["reason"] == "no_capacity" and off.waits.stats.stretched == 0

    run(scenario())
