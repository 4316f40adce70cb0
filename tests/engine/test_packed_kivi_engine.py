"""int4-kivi and k6v4-kivi through the public Engine: the budget is what the store allocates (pages plus the
native tail pool, a replica arena), greedy generation runs and is deterministic, prefix hits read
page-key codes, and every tail slot comes back when its request ends."""
import asyncio

import pytest

from engine.config import EngineConfig
from engine.loop import Engine
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from tests.engine_helpers import PAGE_BYTES_LLAMA, collect, prompt, run, tokens, wait_idle

SEQS = 3


def _req(rid, ids, n=20):
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=n,
                                                      ignore_eos=True))


@pytest.fixture(scope="module", params=["int4-kivi", "k6v4-kivi"])
def engine(tiny_llama, request):
    eng = Engine(EngineConfig(model=tiny_llama, kv_format=request.param, page_tokens=16,
                              kv_budget_bytes=32 * PAGE_BYTES_LLAMA, max_num_seqs=SEQS,
                              max_step_tokens=24, enable_prefix_caching=True))
    yield eng
    eng.shutdown()


def test_budget_is_what_the_store_allocates(engine):
    cm, store = engine.cost_model(), engine.kvstore
    fmt = engine.kvstore.layers[0].fmt   # the tiny llama: 2 layers x 2 KV heads x 64, float32
    assert fmt.page_keys and fmt.native_dtype == "float32"
    assert engine.format_identity == fmt.identity   # float32: ...-n0-tf32
    assert cm.bytes_per_token == store.bytes_per_token == 2 * fmt.bytes_per_token(2, 16)
    assert store.page_bytes == 2 * fmt.bytes_per_page(2, 16)
    assert cm.workspace.fixed == SEQS * store.tail_bytes_per_sequence
    assert cm.budget_bytes == store.nbytes == store.num_pages * store.page_bytes + cm.workspace.fixed
    assert cm.budget_bytes <= 32 * PAGE_BYTES_LLAMA


def test_concurrent_greedy_requests_release_every_tail(engine):
    tails = engine.kvstore.layers[0].tails

    async def batch():
        return await asyncio.gather(*(collect(engine, _req(f"r{i}", prompt(13 + 7 * i, i)))
                                      for i in range(SEQS)))
    outs = run(batch())
    assert all(len(tokens(o)) == 20 for o in outs)
    alone = tokens(run(collect(engine, _req("alone", prompt(13, 0)))))
    assert alone == tokens(outs[0])   # batched or alone, the same greedy tokens
    engine.evict_prefix_cache()
    wait_idle(engine)
    assert tails.used == 0


def test_prefix_hit_reads_full_pages_and_matches_a_cold_run(engine):
    ids = prompt(40, 11)   # two full pages cached, an 8-token tail recomputed
    first = tokens(run(collect(engine, _req("cold", ids))))
    again = run(collect(engine, _req("warm", ids)))
    assert again[-1].usage.cached_tokens == 32
    assert tokens(again) == first
    engine.evict_prefix_cache()
    wait_idle(engine)
    assert engine.kvstore.layers[0].tails.used == 0
