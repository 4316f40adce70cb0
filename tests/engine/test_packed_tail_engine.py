"""Native-tail formats through the public Engine (int4-tail, and int4-kivi / k6v4-kivi, whose page
keys are quantized when a page fills from that tail): the budget is what the store allocates
(pages plus a native tail pool of one page per sequence, priced as a replica arena), greedy
generation is the same batched or alone, prefix hits read full pages' codes, every tail slot
comes back when its request ends, and concurrency up to max_num_seqs never exhausts the pool."""
import asyncio

import pytest

from engine.config import EngineConfig
from engine.errors import EngineError
from engine import Engine
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from tests.engine_helpers import PAGE_BYTES_LLAMA, collect, prompt, run, tokens, wait_idle

SEQS = 3


def _req(rid, ids, n=20):
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=n,
                                                      ignore_eos=True))


# The tiny llama computes in float32, so the tail is f32 (`-tf32`).
IDENTITIES = {"int4-tail": "affine-v3-k4v4-g64x64-f32-h64-s1-n0-tf32-p16",
              "int4-kivi": "affine-v3-k4v4-gcx64-f32-h0-s0-n0-tf32-p16",
              "k6v4-kivi": "affine-v3-k6v4-gcx64-f32-h0-s0-n0-tf32-p16"}


@pytest.fixture(scope="module", params=list(IDENTITIES))
def engine(tiny_llama, request):
    eng = Engine(EngineConfig(model=tiny_llama, kv_format=request.param, page_tokens=16,
                              kv_budget_bytes=32 * PAGE_BYTES_LLAMA, max_num_seqs=SEQS,
                              max_step_tokens=24, enable_prefix_caching=True))
    yield eng
    eng.shutdown()


def test_budget_is_what_the_store_allocates(engine):
    cm, store = engine.cost_model(), engine.kvstore
    fmt = store.layers[0].fmt   # the tiny llama: 2 layers x 2 KV heads x 64, float32
    assert engine.format_identity == IDENTITIES[fmt.name] == fmt.identity
    assert cm.bytes_per_token == store.bytes_per_token == 2 * fmt.bytes_per_token(2, 16)
    assert store.page_bytes == 2 * fmt.bytes_per_page(2, 16)
    assert store.tail_bytes_per_sequence == 2 * fmt.tail_bytes_per_request(2, 16)
    assert cm.workspace.fixed == SEQS * store.tail_bytes_per_sequence
    assert cm.budget_bytes == store.nbytes == store.num_pages * store.page_bytes + cm.workspace.fixed
    assert cm.budget_bytes <= 32 * PAGE_BYTES_LLAMA
    # Requests are charged pages only; the arena is never chargeable.
    assert cm.free_bytes(0) == store.num_pages * store.page_bytes
    assert engine.stats().kv_bytes_total == cm.budget_bytes


def test_concurrent_requests_release_every_tail(engine):
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


def test_a_budget_without_room_for_the_pool_is_refused(tiny_llama):
    with pytest.raises(EngineError, match="native tail"):
        Engine(EngineConfig(model=tiny_llama, kv_format="int4-tail", page_tokens=16,
                            kv_budget_bytes=PAGE_BYTES_LLAMA, max_num_seqs=16))
