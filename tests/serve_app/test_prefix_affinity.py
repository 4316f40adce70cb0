"""Prefix affinity's view of the caches, on a real engine: a replica's report lets the router find
the longest cached prefix of a request for the same tenant, never another tenant's pages, and
pages it routed count until a later report supersedes them."""
import pytest

from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from serve_app.prefix_affinity import PrefixIndex, PrefixReport
from tests.engine_helpers import collect, make_engine, prompt, run, wait_stats

PAGE = 16


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = make_engine(tiny_llama, pages=64, max_step_tokens=32, page_tokens=PAGE,
                      enable_prefix_caching=True)
    yield eng
    eng.shutdown()


def serve(eng, rid, ids, tenant):
    return run(collect(eng, GenerationRequest(rid, ids, SamplingParams(temperature=0.0,
                                                                       max_tokens=2),
                                              tenant=tenant)))


def test_longest_prefix_found_for_its_tenant_only(engine):
    history = prompt(5 * PAGE + 3, seed=11)
    serve(engine, "t1", history, tenant="alice")
    wait_stats(engine, lambda s: s.prefix_cache_pages >= 5)
    index = PrefixIndex()
    index.observe("r-a", PrefixReport(engine)())
    index.observe("r-b", None)    # prefix caching off there: never preferred
    next_turn = history + prompt(40, seed=12)
    match = index.matches(["r-a", "r-b", "r-unknown"], "alice", next_turn)
    assert match == {"r-a": 5 * PAGE, "r-b": 0, "r-unknown": 0}
    # The same tokens from another tenant (API key) match nothing: routing never steers a
    # tenant toward another tenant's pages, and the engine agrees (cached_tokens 0).
    assert index.matches(["r-a"], "bob", next_turn) == {"r-a": 0}
    bob = serve(engine, "t2", next_turn, tenant="bob")
    assert bob[-1].usage.cached_tokens == 0
    alice = serve(engine, "t3", next_turn, tenant="alice")
    assert alice[-1].usage.cached_tokens == 5 * PAGE
    # A prompt that parts from the history inside page 3 matches its first 2 pages only.
    forked = history[:2 * PAGE + 5] + prompt(60, seed=13)
    assert index.matches(["r-a"], "alice", forked) == {"r-a": 2 * PAGE}


def test_routed_pages_count_until_a_later_report(engine):
    index = PrefixIndex()
    report = PrefixReport(engine)
    index.observe("r", report())
    fresh = prompt(3 * PAGE + 1, seed=21)
    assert index.matches(["r"], "carol", fresh) == {"r": 0}
    index.routed("r", index.request_keys("r", "carol", fresh))
    assert index.matches(["r"], "carol", fresh) == {"r": 3 * PAGE}
    # The next report may have been taken before the request's pages were written: the routed
    # pages still count. The one after cannot have been, and it says what is really there.
    index.observe("r", report())
    assert index.matches(["r"], "carol", fresh) == {"r": 3 * PAGE}
    index.observe("r", report())
    assert index.matches(["r"], "carol", fresh) == {"r": 0}


def test_a_report_is_compact(engine):
    rep = PrefixReport(engine)()
    assert len(rep["keys"]) == 8 * engine.stats().prefix_cache_pages
    assert rep["tenant"] == engine.cfg.tenant and rep["page_tokens"] == PAGE
