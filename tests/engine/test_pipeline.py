"""Pipelined decode (the engine queues step n+1 with step n's lazy tokens before reading step n):
same tokens, texts and finish reasons as synchronous steps, for greedy, seeded sampling, EOS,
stop strings, max_tokens and cancellation; refunds only after the last step that used the pages
retired; nothing leaks."""
import asyncio

import pytest

from engine.config import EngineConfig
from engine import Engine
from tests.engine_helpers import PAGE_BYTES_LLAMA, collect, req, run, tokens, wait_idle


class _SyncEngine(Engine):
    pipeline_decode = False


def _requests():
    sampled = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    return [
        req("eos", n_prompt=21, pseed=1, max_tokens=32),          # EOS at its 6th token
        req("long", n_prompt=17, pseed=2, max_tokens=40, ignore_eos=True),
        req("short", n_prompt=5, pseed=3, max_tokens=2, ignore_eos=True),
        req("one", n_prompt=7, pseed=4, max_tokens=1, ignore_eos=True),
        req("samp", n_prompt=12, pseed=5, max_tokens=24, ignore_eos=True, **sampled),
        req("mid", n_prompt=9, pseed=7, max_tokens=13, ignore_eos=True),
    ]


async def _batch(eng, stop=None):
    rs = _requests()
    if stop is not None:
        rs.append(req("stopped", n_prompt=9, pseed=7, max_tokens=24, stop=(stop,)))
    return await asyncio.gather(*(collect(eng, r) for r in rs))


def _summary(outs):
    return [(tokens(d), "".join(x.text for x in d), d[-1].finish_reason,
             d[-1].usage.completion_tokens) for d in outs]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    events = []

    def build(cls, trace=None):
        return cls(EngineConfig(model=tiny_llama, kv_budget_bytes=64 * PAGE_BYTES_LLAMA,
                                page_tokens=16, max_step_tokens=64), trace=trace)
    piped = build(Engine, trace=lambda e, **f: events.append((e, f)))
    sync = build(_SyncEngine)
    yield piped, sync, events
    piped.shutdown()
    sync.shutdown()


def test_pipelined_equals_synchronous_and_refunds_after_retire(engines):
    piped, sync, events = engines
    # A stop string taken from the synchronous run's text of the same prompt.
    full = run(collect(sync, req("full", n_prompt=9, pseed=7, max_tokens=24)))
    text = "".join(d.text for d in full)
    printable = [i for i in range(4, len(text) - 3) if text[i:i + 3].isprintable()]
    stop = text[printable[len(printable) // 2]:][:3]
    wait_idle(sync)

    ahead_before = sum(1 for e, f in events if e == "launch" and f["ahead"])
    got, want = run(_batch(piped, stop)), run(_batch(sync, stop))
    assert _summary(got) == _summary(want)
    ahead_steps = sum(1 for e, f in events if e == "launch" and f["ahead"]) - ahead_before
    assert ahead_steps > 10          # the pipeline really ran
    assert got[0][-1].finish_reason == "stop" and len(tokens(got[0])) == 6   # EOS mid-pipeline
    assert got[-1][-1].finish_reason == "stop"       # the stop string
    assert [len(tokens(d)) for d in got[1:4]] == [40, 2, 1]
    wait_idle(piped)
    wait_idle(sync)
    retired, launched, recorded = [], {}, set()
    for e, f in events:
        if e == "launch":
            launched[f["step"]] = f["requests"]
        elif e == "retire":
            assert not retired or f["step"] > retired[-1]
            retired.append(f["step"])
        elif e == "step":
            # The loop applies a step's result (tokens, counters, the "step" event) only
            # after the runner retired it, and each step once.
            assert retired and f["step"] == retired[-1], f
            assert f["step"] not in recorded, f
            recorded.add(f["step"])
        elif e == "refund":
            # Pages come back only after EVERY step that used them retired, the queued extra
            # step of a request that finished (EOS, stop string, length) included.
            used = [st for st, ids in launched.items() if f["request"] in ids]
            assert f["last_step"] == max(used, default=f["last_step"]), f
            assert all(st in retired for st in used), f
    assert len(recorded) > ahead_steps   # pipelined steps were recorded too


def test_pipelined_cancel_and_repeat(engines):
    piped, sync, _ = engines

    async def scenario(eng):
        a = asyncio.ensure_future(collect(eng, req("c-keep", n_prompt=11, pseed=8,
                                                   max_tokens=30, ignore_eos=True)))
        b = await collect(eng, req("c-gone", n_prompt=13, pseed=9, max_tokens=30,
                                   ignore_eos=True), stop_after=5)
        return await a, b
    (keep, gone), (keep_s, gone_s) = run(scenario(piped)), run(scenario(sync))
    assert tokens(keep) == tokens(keep_s) and len(tokens(keep)) == 30
    assert tokens(gone) == tokens(gone_s)[:len(tokens(gone))] and len(gone) == 5
    s = wait_idle(piped)
    assert s.kv_pages_used == 0 and s.kv_bytes_reserved == 0
    # Same seeds, same tokens on a second run (nothing left behind by the pipeline).
    assert _summary(run(_batch(piped))) == _summary(run(_batch(sync)))
    wait_idle(piped)
