"""The affine wait's bound follows what a hit saves (capacity/affine_bound.py), without Ray: the
prefill time of the cached tokens at the holders' learned rate, capped by the op's wait_s; the
fixed fallback while no rate is learned; an op without saved_tokens waits its wait_s. And the
learned rate a hit would inflate: a request that found most of its prompt cached prices nothing
(capacity/fleet.py, computed_prompt)."""
import asyncio

from capacity.affine_bound import UNLEARNED_WAIT_S, affine_wait_s
from capacity.operations import HoldOp, decode_op, encode_op
from capacity.protocol import RequestTelemetry
from capacity.rates import RequestSample
from tests.capacity.test_wait_affine import fill, service
from tests.fixtures.conditions import until


def learn_prefill(ops, replica: str, tps: float) -> None:
    """Samples of requests that computed their whole prompt: 1000 tokens each at `tps`."""
    key = ops.fleet.ledger.replica("m", replica).key
    for _ in range(5):
        ops.fleet.rates.record_request(key, RequestSample(1000, 1, 1000 / tps, None))


def affine(rid: str, saved: int, wait_s: float = 30.0) -> HoldOp:
    return HoldOp("m", 500, rid, 10, ("r1",), wait_s, True, saved)


def test_the_bound_is_the_saved_prefill_at_the_holders_rate_capped_by_wait_s():
    ops = service()
    # Nothing learned yet: the fixed fallback, still under the op's cap.
    assert affine_wait_s(ops.fleet, affine("a", 640)) == UNLEARNED_WAIT_S
    assert affine_wait_s(ops.fleet, affine("a", 640, wait_s=0.5)) == 0.5
    learn_prefill(ops, "r0", 80.0)
    # 640 cached tokens at 80 tok/s: a hit saves 8 s, so the wait accepts 8 s, not 2 s.
    assert affine_wait_s(ops.fleet, affine("a", 640)) == 8.0
    assert affine_wait_s(ops.fleet, affine("a", 640, wait_s=5.0)) == 5.0
    assert affine_wait_s(ops.fleet, affine("a", 16)) == 0.2
    # An op without saved_tokens (an older router) waits its wait_s, as before.
    assert affine_wait_s(ops.fleet, affine("a", 0, wait_s=3.0)) == 3.0
    # Rates are per execution identity: r1 runs r0's, so it is priced the same.
    assert affine_wait_s(ops.fleet, HoldOp("m", 500, "a", 10, ("r0",), 30.0, True, 640)) == 8.0


def test_a_parked_affine_waiter_runs_out_after_the_saved_prefill_not_its_cap():
    async def scenario():
        ops = service()
        learn_prefill(ops, "r0", 80.0)
        fill(ops)
        loop = asyncio.get_running_loop()
        long = ops.apply([encode_op(affine("long", 640))])[0]
        waiter = ops.waits._by_id["long"]
        assert abs(waiter.timer.when() - loop.time() - 8.0) < 0.5     # not 30 s, not 2 s
        short = ops.apply([encode_op(affine("short", 4))])[0]        # saves 0.05 s
        assert isinstance(long, asyncio.Future) and isinstance(short, asyncio.Future)

        async def short_ran_out():
            return short.done()

        await until(short_ran_out, timeout_s=5, what="the short affine wait running out")
        assert short.result()["reason"] == "no_capacity" and not long.done()
        ops.apply([("cancel", "long")])

    asyncio.run(scenario())


def test_the_wire_carries_saved_tokens_and_a_plain_affine_hold_reads_as_before():
    op = affine("a", 640)
    assert encode_op(op)[-1] == 640 and decode_op(encode_op(op)) == op
    assert decode_op(encode_op(affine("a", 0))).saved_tokens == 0
    assert len(encode_op(affine("a", 0))) == len(encode_op(affine("a", 640))) - 1


def test_hits_do_not_inflate_the_learned_prefill_rate():
    ops = service()
    key = ops.fleet.ledger.replica("m", "r0").key
    for i in range(5):   # uncached: 1000 tokens in 10 s
        ops.apply([("hold", "m", 100, f"miss{i}", 1000, ("r1",)), ("release", f"miss{i}",
                   RequestTelemetry(prompt_tokens=1000, ttft_s=10.0).model_dump())])
    for i in range(9):   # hits: 1000-token prompts, 900 cached, 1 s each
        ops.apply([("hold", "m", 100, f"hit{i}", 1000, ("r1",)), ("release", f"hit{i}",
                   RequestTelemetry(prompt_tokens=1000, cached_tokens=900,
                                    ttft_s=1.0).model_dump())])
    # Counted at 1000 tokens a second the hits would set the median; they price nothing.
    assert ops.fleet.rates.prefill_tps(key) == 100.0
