"""Fused prefill through the Engine: workspace permits from the byte ledger, held by a step until
it retires; refusals fall back to direct; deadline arrivals look at the engine only after the
fused step retired; refunds never precede retirement and the workspace is gone when they happen.

How the scenarios are made deterministic: the tiny llama in int8 with 16-token pages and
16-token steps. A 40-token prompt prefills in steps of 16 / 16 / 8 tokens; only the middle one is
fused-eligible (history and >= 9 queries), and it asks one permit per layer of exactly
`fused_workspace_bytes` = 4 * (2*1*2*32*64 + 2*1*4*16*64) = 65536 bytes. Budgets are chosen in
pages (9216 bytes each) around those numbers. Arrivals are injected from the trace hook while the
permit is held (the hook blocks the engine thread until the arrival is queued); no clock is faked.
"""
import asyncio
import threading
import time

import pytest

from engine.kv.budget import ByteLedger, build_cost_model
from engine.config import EngineConfig
from engine.errors import DeadlineUnmeetable
from engine import Engine
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from tests.engine_helpers import collect, prompt, run, tokens

PAGE = 16 * 576            # int8 tiny llama: 2 layers x 2 heads x (72 + 72) bytes per token
PERMIT = 65536             # one layer's fused scratch for the 16-query step over 16 history rows


class Trace:
    def __init__(self):
        self.events = []
        self.lock = threading.Lock()
        self.hook = None

    def __call__(self, event, **f):
        with self.lock:
            self.events.append((event, f))
        if self.hook is not None:
            self.hook(event, f)

    def index(self, event, **match):
        return next(i for i, (e, f) in enumerate(self.events)
                    if e == event and all(f.get(k) == v for k, v in match.items()))

    def of(self, event):
        return [f for e, f in self.events if e == event]


def engine(model, pages, trace=None, mode="fused", **kw):
    return Engine(EngineConfig(model=model, kv_format="int8", prefill_mode=mode, page_tokens=16,
                               max_step_tokens=16, kv_budget_bytes=pages * PAGE, **kw),
                  trace=trace)


def greq(rid, n_prompt, max_tokens, pseed=0, deadline=None):
    return GenerationRequest(rid, prompt(n_prompt, pseed),
                             SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                            ignore_eos=True),
                             first_token_deadline=deadline)


def pages(raw):
    return -(-raw // 16)


def assert_permits_die_with_their_step(trace):
    """Every permit is released exactly when its own step retired: the release event follows
    that step's retire event immediately and returns all the step's granted bytes."""
    granted = {}
    for f in trace.of("permit"):
        assert f["step"] is not None
        if f["granted"]:
            granted[f["step"]] = granted.get(f["step"], 0) + f["nbytes"]
    for step, nbytes in granted.items():
        r = trace.index("retire", step=step)
        assert trace.index("permit", step=step) < r
        event, f = trace.events[r + 1]
        assert (event, f["step"], f["nbytes"]) == ("release", step, nbytes)
    return granted


def test_ledger_permit_belongs_to_the_step_not_the_request():
    cm = build_cost_model(budget_bytes=20 * PAGE, bytes_per_token=576, page_tokens=16,
                          fixed_bytes_per_request=0, max_num_seqs=4, token_limit=4096)
    ledger = ByteLedger(cm)
    ledger.reserve("a", 44)
    assert ledger.reserve_workspace(7, PERMIT) and ledger.workspace_bytes == PERMIT
    ledger.refund("a")                          # the request goes (cancel, finish) ...
    assert ledger.used_bytes == ledger.workspace_bytes == PERMIT   # ... the permit stays
    assert not ledger.reserve_workspace(8, 20 * PAGE)              # refusal never over-commits
    assert ledger.release_workspace(7) == PERMIT and ledger.used_bytes == 0


def test_fused_steps_take_permits_released_at_retirement(tiny_llama):
    trace = Trace()
    eng = engine(tiny_llama, pages=64, trace=trace)
    try:
        async def both():
            return await asyncio.gather(collect(eng, greq("a", 40, 4)),
                                        collect(eng, greq("b", 40, 4, pseed=1)))
        run(both())
        c = eng.stats().kv_path_counters
        assert c["fused"] >= 2 and c["budget_fallback"] == 0 and c["ineligible_fallback"] > 0
        granted = assert_permits_die_with_their_step(trace)
        assert granted and all(n >= PERMIT for n in granted.values())
        assert eng.stats().kv_workspace_bytes == 0 and eng.stats().kv_bytes_reserved == 0
    finally:
        eng.shutdown()


def test_cancelling_the_request_does_not_refund_its_steps_permit(tiny_llama):
    trace = Trace()
    eng = engine(tiny_llama, pages=64, trace=trace)
    seen = []

    def cancel_on_first_permit(event, f):
        if event == "permit" and f["granted"] and not seen:
            seen.append(f)
            eng.cancel("a")            # arrives while the step that took the permit is built
    trace.hook = cancel_on_first_permit
    try:
        out = run(collect(eng, greq("a", 40, 50)))
        assert [d.finish_reason for d in out] == ["cancelled"]
        step = seen[0]["step"]
        granted = assert_permits_die_with_their_step(trace)
        assert granted[step] == 2 * PERMIT                      # both layers' permits held ...
        refund = trace.index("refund", request="a")
        release = trace.index("release", step=step)
        assert release < refund                                 # ... until the step retired,
        assert trace.of("refund")[0]["last_step"] == step       # not by the cancel's refund
        assert eng.stats().kv_workspace_bytes == 0
    finally:
        eng.shutdown()


def test_refused_permit_runs_direct_for_the_whole_call_and_is_counted(tiny_llama):
    # Exactly the request's pages: once it is admitted nothing is free for a fused scratch.
    tight = engine(tiny_llama, pages=pages(44), trace=(trace := Trace()))
    direct = engine(tiny_llama, pages=pages(44), mode="direct")
    try:
        got = tokens(run(collect(tight, greq("a", 40, 4))))
        want = tokens(run(collect(direct, greq("a", 40, 4))))
        c = tight.stats().kv_path_counters
        assert c["budget_fallback"] == 2 and c["fused"] == 0     # the fused step's two layers
        assert [f["granted"] for f in trace.of("permit")] == [False, False]
        assert got == want                                      # fallback = the direct path
        assert all(f["nbytes"] == 0 for f in trace.of("release"))
    finally:
        tight.shutdown()
        direct.shutdown()


def _arrival_scenario(eng, trace, b_deadline_s, slow_retirement, a_max_tokens):
    """A (40-token prompt) runs; at its fused step's first permit, B arrives (the engine thread
    waits until B is queued and, for a `slow_retirement`, until B's deadline has passed)."""
    result = {}

    async def scenario():
        loop = asyncio.get_running_loop()
        permit_seen = loop.create_future()
        queued = threading.Event()

        def hook(event, f):
            if event == "permit" and f["granted"] and "step" not in result:
                result["step"] = f["step"]
                result["free_at_arrival"] = f["free_bytes"]
                loop.call_soon_threadsafe(permit_seen.set_result, None)
                queued.wait(10)
                if slow_retirement:
                    wait = result["deadline"] - time.monotonic()
                    threading.Event().wait(max(wait, 0.0) + 0.01)
        trace.hook = hook
        a = asyncio.ensure_future(collect(eng, greq("A", 40, a_max_tokens)))
        await permit_seen
        result["deadline"] = time.monotonic() + b_deadline_s
        b = eng.generate(greq("B", 8, 232, pseed=2, deadline=result["deadline"]))
        first = asyncio.ensure_future(b.__anext__())
        while eng._inbox.empty():          # B's submit runs up to its first await: in the inbox
            await asyncio.sleep(0)
        queued.set()
        try:
            result["b_first"] = await first
            result["b_first_at"] = time.monotonic()
            await b.aclose()
        except DeadlineUnmeetable as e:
            result["b_error"] = e
        if a_max_tokens > 50:
            eng.cancel("A")
        result["a"] = await a
    run(scenario())
    return result


def test_deadline_arrival_fits_only_because_the_fused_step_retired(tiny_llama):
    trace = Trace()
    a_raw, b_raw = 40 + 400, 8 + 232
    # Budget = A + B exactly: B fits beside A, but not while A's fused step holds its permit.
    eng = engine(tiny_llama, pages=pages(a_raw) + pages(b_raw), trace=trace)
    try:
        cm = eng.cost_model()
        r = _arrival_scenario(eng, trace, b_deadline_s=5.0, slow_retirement=False,
                              a_max_tokens=400)
        charge_b = cm.charge_bytes(b_raw)
        # While the step held its permit(s) B did not fit; the permit is what it lacked.
        assert r["free_at_arrival"] < charge_b <= r["free_at_arrival"] + 2 * PERMIT
        arrival = trace.of("arrival")[1]
        assert arrival["request"] == "B" and arrival["retired_step"] == r["step"]
        assert arrival["workspace_bytes"] == 0 and arrival["free_bytes"] == charge_b  # fits now
        # Between B's arrival and its admission the only ledger change is that step's release:
        # A still runs, no refund happened, B waited for no other step.
        i_release, i_arrival = trace.index("release", step=r["step"]), trace.index("arrival",
                                                                                   request="B")
        i_admit = trace.index("admit", request="B")
        assert i_release < i_arrival < i_admit
        assert not [e for e, _ in trace.events[i_release:i_admit] if e in ("refund", "retire")]
        assert trace.events[i_admit][1]["retired_step"] == r["step"]
        assert r["b_first"].token_ids and r["b_first"].finish_reason is None
        assert r["b_first_at"] <= r["deadline"]
        assert r["a"][-1].finish_reason == "cancelled" and tokens(r["a"])
    finally:
        eng.shutdown()


def test_deadline_expires_during_retirement_and_the_prefill_work_is_kept(tiny_llama):
    trace = Trace()
    eng = engine(tiny_llama, pages=64, trace=trace)
    try:
        alone = tokens(run(collect(eng, greq("ref", 40, 8))))
        before = eng.stats().prompt_tokens_total
        trace.events.clear()
        r = _arrival_scenario(eng, trace, b_deadline_s=0.05, slow_retirement=True, a_max_tokens=8)
        assert isinstance(r["b_error"], DeadlineUnmeetable)
        arrival = next(f for f in trace.of("arrival") if f["request"] == "B")
        # B was looked at after the step retired, against its original absolute deadline,
        # which passed during the retirement.
        assert arrival["retired_step"] == r["step"] and arrival["now"] >= arrival["deadline"]
        assert arrival["deadline"] == pytest.approx(r["deadline"], abs=1e-6)
        assert trace.index("release", step=r["step"]) < trace.index("arrival", request="B")
        # A's partial prefill (the fused step included) is kept: same tokens as alone, and its
        # 40 prompt tokens were computed once.
        assert tokens(r["a"]) == alone
        s = eng.stats()
        assert s.prompt_tokens_total - before == 40
        assert s.requests["refused_deadline"] == 1 and s.kv_bytes_reserved == 0
    finally:
        eng.shutdown()


def test_refund_never_precedes_retirement_and_the_workspace_is_gone_by_then(tiny_llama):
    """What is measured: mx.get_peak_memory() is reset when a step starts, so `peak` in its
    release event is that step's high-water mark; `active_before`/`active_after` are
    mx.get_active_memory() just before and after the engine drops the step's device results
    (logits and sampled ids). KV pages are preallocated, so releasing pages frees no MLX memory
    by design; what a refund can free is the step's transient memory. For every fused step the
    peak exceeds the memory left after the release by at least one permitted scratch, i.e. the
    workspace the permit paid for was really allocated and is really gone when its bytes return
    to the ledger; and dropping the step's results lowers active memory inside the release."""
    trace = Trace()
    eng = engine(tiny_llama, pages=64, trace=trace)
    try:
        async def many():
            return await asyncio.gather(*(collect(eng, greq(f"r{i}", 40, 3 + i, pseed=i))
                                          for i in range(3)))
        run(many())
        retired = -1
        for i, (event, f) in enumerate(trace.events):
            if event == "retire":
                retired = f["step"]
            elif event == "refund":
                assert f["last_step"] <= retired
                j = trace.index("release", step=f["last_step"])
                assert j < i                                    # workspace returned first
            elif event == "release":
                assert f["step"] == retired                     # right at its retirement
                assert f["active_after"] < f["active_before"]   # the step's results freed
        fused = [f for f in trace.of("release") if f["nbytes"]]
        assert fused
        for f in fused:
            assert f["peak"] - f["active_after"] >= PERMIT
        assert len(trace.of("refund")) == 3
    finally:
        eng.shutdown()
