"""Affine waits (capacity/waiting.py) through the actor's batch path, without Ray: a hold that may
go only to the replicas caching its prefix (the others excluded) waits beside the FIFO for them,
never blocks the FIFO's head, is granted when a holder frees (arrival order deciding between it
and the FIFO's head), runs out to the usual refusal, and is cancelled like any waiter. Plus the
wire form: an affine hold carries one more trailing field, a plain one reads as before."""
import asyncio

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from capacity.fleet import Fleet, FleetConfig
from capacity.operations import HoldOp, decode_op, encode_op
from capacity.ops import BatchOps
from tests.capacity.test_wait import (RETRY, FakeClock, beat, capped_service, other_step,
                                      outstanding, run)


REPLICAS = ("r0", "r1")


def service() -> BatchOps:
    """Model m on two replicas, r0 and r1, of 1000 raw tokens each."""
    fleet = Fleet(FleetConfig.from_dict({"caps": {"native_seeds": {"m": 400.0}},
                                         "ledger": {"retry_after_s": RETRY}}))
    ops = BatchOps(fleet)
    ops.apply([("heartbeat", beat(1)), ("heartbeat", beat(1, replica="r1"))])
    return ops


def hold(ops, rid, raw, exclude=(), wait_s=0.0, affine=False, owner=None):
    return ops.apply([encode_op(HoldOp("m", raw, rid, None, exclude, wait_s, affine))], owner)[0]


def on(out) -> str:
    assert out["ok"], out
    return out["hold"].replica_id


def fill(ops):
    """Both replicas full: "a" on r0, "b" on r1."""
    assert on(hold(ops, "a", 1000, exclude=("r1",))) == "r0"
    assert on(hold(ops, "b", 1000, exclude=("r0",))) == "r1"


def test_an_affine_waiter_does_not_block_the_fifo_head():
    async def scenario():
        ops = service()
        fill(ops)
        x = hold(ops, "x", 500, exclude=("r1",), wait_s=10, affine=True)   # wants r0 only
        f = hold(ops, "f", 500, wait_s=10)                                 # anywhere
        assert ops.waits.affine_waiting("m") == ["x"] and ops.waits.waiting("m") == ["f"]
        ops.apply([("release", "b", None)])          # r1 frees: x cannot take it, f can
        assert on(await f) == "r1" and not x.done()
        assert ops.waits.affine_waiting("m") == ["x"] and outstanding(ops) == 1500
        ops.apply([("release", "a", None)])          # its holder frees
        assert on(await x) == "r0" and outstanding(ops) == 1000
        assert ops.waits.stats.affine_granted == 1 and ops.waits.stats.affine_parked == 1
        assert len(ops.waits) == 0

    run(scenario())


def test_a_hold_by_headroom_ends_the_same_requests_affine_wait():
    """The router's fallback after its affine wait: the same request id, held by headroom. Left
    parked, the affine waiter could later be granted beside that hold (two reservations)."""
    async def scenario():
        ops = service()
        assert on(hold(ops, "b", 1000, exclude=("r0",))) == "r1"           # the holder full
        x = hold(ops, "x", 500, exclude=("r0",), wait_s=10, affine=True)   # waits for r1
        assert ops.waits.affine_waiting("m") == ["x"]
        assert on(hold(ops, "x", 500, wait_s=10)) == "r0"                  # headroom: r0
        assert (await x)["reason"] == "cancelled" and len(ops.waits) == 0
        ops.apply([("release", "b", None)])         # the holder frees: nothing left to grant
        assert outstanding(ops) == 500

    run(scenario())


def test_arrival_order_decides_between_an_affine_waiter_and_the_fifo_head():
    async def scenario():
        ops = service()
        fill(ops)
        early = hold(ops, "early", 500, exclude=("r1",), wait_s=10, affine=True)
        head = hold(ops, "head", 1000, wait_s=10)
        late = hold(ops, "late", 500, exclude=("r1",), wait_s=10, affine=True)
        ops.apply([("release", "a", None)])          # r0 frees: the earlier affine waiter first
        assert on(await early) == "r0" and not head.done() and not late.done()
        ops.apply([("release", "early", None)])      # r0 again: the FIFO's head came before late
        assert on(await head) == "r0" and not late.done()
        # A newcomer that could go anywhere does not take the holder's room from a waiter either:
        # room on r0 is granted to late the moment it appears, before any later hold is read.
        ops.apply([("release", "head", None), ("hold", "m", 500, "n")])
        assert on(await late) == "r0"

    run(scenario())


def test_an_affine_wait_runs_out_to_the_usual_refusal():
    async def scenario():
        ops = service()
        fill(ops)
        out = await hold(ops, "x", 500, exclude=("r1",), wait_s=0.1, affine=True)
        assert out == {**out, "ok": False, "reason": "no_capacity", "retry_after_s": RETRY}
        assert ops.waits.stats.affine_timed_out == 1 and ops.waits.stats.stretched == 0
        ops.apply([("release", "a", None)])
        assert ops.fleet.ledger.reservation("x") is None and len(ops.waits) == 0
        # The router's ordinary hold with the same request id then goes where there is room.
        assert on(hold(ops, "x", 500, wait_s=10)) == "r0"

    run(scenario())


def test_an_affine_waiter_is_never_admitted_above_the_cap():
    async def scenario():
        clock = FakeClock()
        ops = capped_service(clock)                  # cap 3; FIFO waiters stretch after 1 s
        assert [ops.apply([("hold", "m", 10, r)])[0]["ok"] for r in "abc"] == [True] * 3
        x = hold(ops, "x", 10, wait_s=30, affine=True)
        clock.now += 1.5
        ops.apply([("heartbeat", beat(2, active=[(r, 10) for r in "abc"]))])
        assert not x.done() and ops.waits.stats.stretched == 0
        ops.apply([("release", "a", None),           # under the cap again: now it fits
                   ("heartbeat", beat(3, active=[(r, 10) for r in "bc"]))])
        assert (await x)["ok"] and outstanding(ops) == 30

    run(scenario())


def test_an_affine_waiter_is_cancelled_dropped_and_tombstoned_like_any():
    async def scenario():
        ops = service()
        fill(ops)
        conn = object()
        x = hold(ops, "x", 500, exclude=("r1",), wait_s=10, affine=True)
        y = hold(ops, "y", 500, exclude=("r1",), wait_s=10, affine=True, owner=conn)
        assert hold(ops, "x", 500, exclude=("r1",), wait_s=10, affine=True) is x   # a resend
        assert ops.apply([("cancel", "x")]) == [True]
        assert (await x)["reason"] == "cancelled"
        ops.waits.drop_owner(conn)
        assert (await y)["reason"] == "cancelled"
        assert ops.apply([("cancel", "z")]) == [False]           # overtook its hold
        assert hold(ops, "z", 500, exclude=("r1",), wait_s=10, affine=True)["reason"] == \
            "cancelled"
        ops.apply([("release", "a", None)])
        led = ops.fleet.ledger
        assert all(led.reservation(r) is None for r in "xyz") and len(ops.waits) == 0
        # Its holders retired while it waited: refused at once, so headroom decides.
        assert on(hold(ops, "fill", 1000, exclude=("r1",))) == "r0"
        w = hold(ops, "w", 500, exclude=("r1",), wait_s=10, affine=True)
        ops.apply([("retire", ["r0"])])
        assert (await w)["reason"] == "no_capacity" and len(ops.waits) == 0

    run(scenario())


def test_the_wire_form_stays_backwards_compatible():
    plain = encode_op(HoldOp("m", 10, "a", 4, ("r1",), 2.5))
    assert plain == ["hold", "m", 10, "a", 4, ("r1",), 2.5]              # the 7 fields of before
    assert encode_op(HoldOp("m", 10, "a")) == ["hold", "m", 10, "a"]
    affine = encode_op(HoldOp("m", 10, "a", 4, ("r1",), 2.5, True))
    assert len(affine) == 8 and affine[-1] is True
    for wire in (plain, affine):
        carried = msgpack.unpackb(msgpack.packb(wire))                   # the direct connection
        assert decode_op(carried) == decode_op(wire)
    assert decode_op(plain).affine is False and decode_op(affine).affine is True
    assert isinstance(decode_op(["hold", "m", 10, "a", None, [], 1.0]).exclude, tuple)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "wait", "affine", "release", "cancel",
                                           "beat"]),
                          st.integers(0, 7), st.integers(100, 700), st.sampled_from(REPLICAS)),
                max_size=40))
def test_affine_and_fifo_waiters_keep_the_ledger_invariants(steps):
    async def scenario():
        ops = service()
        seq = 1
        futures = []
        for kind, i, raw, holder in steps:
            rid = f"q{i}"
            if kind in ("hold", "wait", "affine"):
                others = tuple(r for r in REPLICAS if r != holder)
                out = hold(ops, rid, raw, exclude=others if kind == "affine" else (),
                           wait_s=0 if kind == "hold" else 30, affine=kind == "affine")
                # A repeated id is a resend: its waiter (and holders) are the first op's.
                if isinstance(out, asyncio.Future) and all(out is not f for f, _ in futures):
                    futures.append((out, holder if kind == "affine" else None))
            else:
                seq = other_step(ops, kind, rid, seq, raw, replica=holder)
            outstanding(ops)                  # conserved, never above a replica's budget
            for rep in ops.fleet.ledger.replicas("m"):
                assert ops.fleet.ledger.headroom(rep, ops.clock()).max_request >= 0
            for rid_w in ops.waits.waiting():
                assert ops.fleet.ledger.reservation(rid_w) is None   # waiting debits nothing
            # Nobody waits in the FIFO while a replica has room for its head.
            fifo = ops.waits.waiting("m")
            if fifo:
                head = ops.waits._by_id[fifo[0]]
                assert not ops.waits._fits("m", head.raw_tokens, head.exclude)
        for fut, holder in futures:             # an affine grant is on its holder only
            if fut.done() and not fut.cancelled() and fut.result()["ok"] and holder:
                assert fut.result()["hold"].replica_id == holder
            fut.cancel()

    run(scenario())
