"""Cancellation, deadlines, retire-then-refund ordering, fault isolation and shutdown on the real
Engine with the tiny llama."""
import asyncio
import threading
import time

import pytest

from engine.errors import DeadlineUnmeetable, EngineError, EngineShutdown
from tests.engine_helpers import collect, make_engine, req, run, started, tokens, wait_idle


class Trace:
    """Records the engine thread's retire/refund events in order."""

    def __init__(self):
        self.events = []
        self.lock = threading.Lock()
        self.on_retire = None

    def __call__(self, event, **fields):
        with self.lock:
            self.events.append((event, fields))
        if event == "retire" and self.on_retire:
            self.on_retire(fields["step"])

    def assert_refunds_follow_retirement(self):
        retired = -1
        refunds = 0
        for event, f in self.events:
            if event == "retire":
                retired = max(retired, f["step"])
            elif event == "refund":
                refunds += 1
                assert f["last_step"] <= retired, f"{f['request']} refunded before its step retired"
        return refunds


@pytest.fixture()
def traced(tiny_llama):
    trace = Trace()
    eng = make_engine(tiny_llama, pages=64, max_step_tokens=16, trace=trace)
    yield eng, trace
    eng.shutdown()


def test_cancel_mid_prefill(traced):
    eng, trace = traced
    steps = []

    def cancel_after_two_prefill_steps(step):
        steps.append(step)
        if len(steps) == 2:
            eng.cancel("long")
    trace.on_retire = cancel_after_two_prefill_steps
    deltas = run(collect(eng, req("long", n_prompt=200, max_tokens=5)))
    assert [d.finish_reason for d in deltas] == ["cancelled"] and tokens(deltas) == []
    assert len(steps) < 200 // 16      # stopped well before the prompt was prefilled
    wait_idle(eng)
    assert trace.assert_refunds_follow_retirement() == 1


def test_cancel_mid_decode_and_by_closing_the_stream(traced):
    eng, trace = traced

    async def scenario():
        agen = eng.generate(req("dec", n_prompt=8, max_tokens=200, ignore_eos=True))
        got = [await agen.__anext__() for _ in range(3)]
        eng.cancel("dec")
        eng.cancel("dec")                       # idempotent
        got += [d async for d in agen]
        closed = await collect(eng, req("closer", n_prompt=8, max_tokens=200, ignore_eos=True),
                               stop_after=2)
        return got, closed
    got, closed = run(scenario())
    assert got[-1].finish_reason == "cancelled" and 3 <= len(tokens(got)) < 200
    assert len(closed) == 2
    s = wait_idle(eng)                          # closing the iterator cancelled "closer"
    assert s.requests["finished_cancelled"] == 2
    assert trace.assert_refunds_follow_retirement() == 2


def test_deadline_expires_while_queued_and_unmeetable_is_refused(tiny_llama):
    """"late" arrives while "big" holds the whole budget, so it queues; the engine thread is held
    (in the trace hook, between big's steps) until late's deadline has passed, so big cannot
    finish and free room first however fast the machine is: late must expire while queued."""
    late_deadline, late_queued = [], threading.Event()

    def hold_until_late_expired(event, **fields):
        if event == "arrival" and fields["request"] == "late":
            late_queued.set()
        elif event == "retire" and late_queued.is_set():
            wait = late_deadline[0] - time.monotonic()
            if wait > 0:
                threading.Event().wait(wait)     # the condition is the clock passing a deadline

    eng = make_engine(tiny_llama, pages=8, max_step_tokens=16,     # 128 tokens: one big request
                      trace=hold_until_late_expired)
    try:
        async def scenario():
            big, got = await started(eng, req("big", n_prompt=20, max_tokens=100,
                                               ignore_eos=True))
            late_deadline.append(time.monotonic() + 0.1)
            late = await collect(eng, req("late", n_prompt=8, max_tokens=4,
                                          deadline=late_deadline[0]))
            with pytest.raises(DeadlineUnmeetable):
                await collect(eng, req("past", deadline=time.monotonic() - 1))
            return got + [d async for d in big], late
        big, late = run(scenario())
        assert big[-1].finish_reason == "length"
        assert [d.finish_reason for d in late] == ["deadline"] and tokens(late) == []
        s = wait_idle(eng)
        assert s.requests["finished_deadline"] == 1
        assert s.requests["refused_deadline"] == 1
    finally:
        eng.shutdown()


def test_forecast_refuses_a_deadline_it_cannot_meet(traced):
    eng, _ = traced
    run(collect(eng, req("warm", n_prompt=64, max_tokens=2)))     # measure prefill speed
    tps = eng.stats().prefill_tokens_per_s
    assert tps > 0
    with pytest.raises(DeadlineUnmeetable) as e:
        run(collect(eng, req("tight", n_prompt=500, max_tokens=2,
                             deadline=time.monotonic() + 0.2 * 500 / tps)))
    assert e.value.forecast_s > 0.2 * 500 / tps


def test_a_failing_request_does_not_kill_the_engine(traced):
    """FAKE FAULT: no real input makes the MLX forward raise (bad inputs are refused before the
    engine thread), so the runner is wrapped to raise for one sequence. The engine must fail only
    that request, keep serving the others in the same step, and stay healthy."""
    eng, trace = traced
    real_forward = eng.runner.forward

    def faulty(chunks):
        if any(c.token_ids[0] == 13 and c.start == 0 for c in chunks):
            raise RuntimeError("injected fault")
        return real_forward(chunks)
    eng.runner.forward = faulty
    bad = req("bad", n_prompt=8, max_tokens=4)
    bad.prompt_ids[0] = 13

    async def scenario():
        good = asyncio.ensure_future(collect(eng, req("good", n_prompt=8, pseed=4, max_tokens=6)))
        with pytest.raises(EngineError, match="injected fault"):
            await collect(eng, bad)
        return await good
    good = run(scenario())
    assert good[-1].finish_reason in ("length", "stop") and eng.healthy()
    wait_idle(eng)
    trace.assert_refunds_follow_retirement()


def test_shutdown_drains_then_refuses(tiny_llama):
    eng = make_engine(tiny_llama, pages=16)

    async def scenario():
        running, got = await started(eng, req("drain", max_tokens=30, ignore_eos=True))
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown, 10.0)
        return got + [d async for d in running]
    deltas = run(scenario())
    assert deltas[-1].finish_reason == "length" and not eng.healthy()
    with pytest.raises(EngineShutdown):
        run(collect(eng, req("after")))
    s = eng.stats()
    assert s.kv_pages_used == 0 and s.kv_bytes_reserved == 0


def test_shutdown_timeout_cancels_what_is_left(tiny_llama):
    eng = make_engine(tiny_llama, pages=16)

    async def scenario():
        running, got = await started(eng, req("slow", max_tokens=200, ignore_eos=True))
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown, 0.0)
        return got + [d async for d in running]
    deltas = run(scenario())
    assert deltas[-1].finish_reason == "cancelled"
    assert eng.stats().kv_bytes_reserved == 0
