"""Packed KV through the public Engine API: admission prices packed bytes, int8 greedy = native."""
import asyncio

import pytest

from capacity.formats import KVFormat
from engine.config import EngineConfig
from engine import Engine
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from tests.engine_helpers import collect, run, tokens, wait_idle

BUDGET = 64 * 16 * 2048   # 64 native pages of the tiny llama


@pytest.fixture(scope="module")
def engines(tiny_llama):
    made = {f: Engine(EngineConfig(model=tiny_llama, kv_format=f, kv_budget_bytes=BUDGET,
                                   page_tokens=16, max_step_tokens=48))
            for f in ("native", "int8")}
    yield made
    for e in made.values():
        e.shutdown()


def _req(rid, ids, n=32):
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=n,
                                                      ignore_eos=True))


def test_engine_prices_and_names_packed_storage(engines):
    native, packed = engines["native"].cost_model(), engines["int8"].cost_model()
    # Two full-attention layers, 2 KV heads x 64: int8 rows are 64 + 4 + 4 bytes.
    assert packed.bytes_per_token == 2 * KVFormat("int8", 64).bytes_per_token(2) == 2 * 2 * 144
    assert native.bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert engines["int8"].format_identity == "affine-v1-k8v8-g64-f32-h64-s1"
    # Same byte budget, 3.56x the raw tokens against a float32 native cache.
    assert packed.max_raw_tokens() > 3.5 * native.max_raw_tokens()


def test_int8_greedy_equals_native_alone_and_batched(engines):
    # The tiny model's near-tie-free prompt (see tests/engine/runner/test_packed_engine.py: ties flip any KV change).
    ids = engines["native"].tokenizer.encode("class Point:\n    x: int\n")
    want = tokens(run(collect(engines["native"], _req("n", ids))))
    got = tokens(run(collect(engines["int8"], _req("p", ids))))
    assert got == want and len(want) == 32

    async def batched():
        return await asyncio.gather(
            collect(engines["int8"], _req("long", ids * 7, 20)),   # 70 tokens: 2 chunks
            collect(engines["int8"], _req("main", ids)),
            collect(engines["int8"], _req("short", ids[:5], 8)))
    _, main, _ = run(batched())
    assert tokens(main) == want
    wait_idle(engines["int8"])
