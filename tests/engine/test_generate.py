"""The real Engine on the tiny llama: streaming, batching exactness, seeds, stop strings, budget."""
import asyncio

import pytest

from engine.errors import InvalidRequest, RequestTooLarge
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from tests.engine_helpers import collect, make_engine, req, run, started, tokens, wait_idle


@pytest.fixture(scope="module")
def eng(tiny_llama):
    e = make_engine(tiny_llama, pages=64, max_step_tokens=48)
    yield e
    e.shutdown()


def test_stream_shape_usage_and_ttft(eng):
    deltas = run(collect(eng, req("shape", n_prompt=10, max_tokens=6)))
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
    assert deltas[0].ttft_s is not None and deltas[0].ttft_s > 0
    assert all(d.ttft_s is None for d in deltas[1:])
    assert deltas[-1].usage.prompt_tokens == 10 and deltas[-1].usage.completion_tokens == 6
    assert len(tokens(deltas)) == 6
    s = wait_idle(eng)
    assert s.requests["finished_length"] >= 1
    # The preallocated KV never exceeds the configured budget, and the ledger prices it exactly.
    assert eng.kvstore.nbytes == s.kv_bytes_total <= eng.cfg.kv_budget_bytes
    assert eng.cost_model().budget_bytes == s.kv_bytes_total


def test_greedy_alone_equals_batched_with_different_lengths(eng):
    """32 greedy tokens of a prompt alone and next to others of different lengths (the 60-token
    neighbour is prefilled in two chunks while the others decode)."""
    alone = tokens(run(collect(eng, req("alone", n_prompt=21, pseed=1, max_tokens=32,
                                        ignore_eos=True))))

    async def batched():
        return await asyncio.gather(
            collect(eng, req("b-long", n_prompt=60, pseed=2, max_tokens=40)),
            collect(eng, req("b-main", n_prompt=21, pseed=1, max_tokens=32, ignore_eos=True)),
            collect(eng, req("b-short", n_prompt=3, pseed=3, max_tokens=12)))
    _, main, _ = run(batched())
    assert tokens(main) == alone and len(alone) == 32
    wait_idle(eng)


def test_seeded_sampling_is_reproducible_alone_and_batched(eng):
    sampled = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    a = tokens(run(collect(eng, req("s1", n_prompt=12, pseed=5, **sampled))))
    b = tokens(run(collect(eng, req("s2", n_prompt=12, pseed=5, **sampled))))

    async def batched():
        return await asyncio.gather(
            collect(eng, req("s-other", n_prompt=30, pseed=6, temperature=1.0, max_tokens=20)),
            collect(eng, req("s3", n_prompt=12, pseed=5, **sampled)))
    _, c = run(batched())
    assert a == b == tokens(c)
    d = tokens(run(collect(eng, req("s4", n_prompt=12, pseed=5,
                                    **{**sampled, "seed": 99}))))
    assert d != a


def test_stop_string_ends_text_before_the_match(eng):
    full = run(collect(eng, req("full", n_prompt=9, pseed=7, max_tokens=24)))
    text = "".join(d.text for d in full)
    printable = [i for i in range(4, len(text) - 3) if text[i:i + 3].isprintable()]
    cut = printable[len(printable) // 2]
    stop = text[cut:cut + 3]
    first = text.find(stop)
    got = run(collect(eng, req("stopped", n_prompt=9, pseed=7, max_tokens=24, stop=(stop,))))
    assert got[-1].finish_reason == "stop"
    assert "".join(d.text for d in got) == text[:first]
    wait_idle(eng)


def test_request_larger_than_budget_is_refused_others_undisturbed(eng):
    before = eng.stats().requests["refused_too_large"]

    async def scenario():
        ok = asyncio.ensure_future(collect(eng, req("fine", n_prompt=20, max_tokens=20)))
        with pytest.raises(RequestTooLarge, match="fits at most 1024"):
            await collect(eng, req("huge", n_prompt=900, max_tokens=200))
        return await ok
    deltas = run(scenario())
    assert deltas[-1].finish_reason == "length" and len(tokens(deltas)) == 20
    s = wait_idle(eng)
    assert s.requests["refused_too_large"] == before + 1


def test_bad_inputs_are_refused_before_the_engine_thread(eng):
    with pytest.raises(InvalidRequest):
        GenerationRequest("x", [], SamplingParams())
    with pytest.raises(InvalidRequest, match="out of range"):
        run(collect(eng, GenerationRequest("x", [10**6], SamplingParams())))
    before = eng.stats().requests["refused_invalid"]

    async def duplicate():
        # The first "dup" cannot finish on its own before the duplicate arrives: it is running
        # (first delta seen) and has far more tokens to go; it is cancelled afterwards.
        first, got = await started(eng, req("dup", n_prompt=40, max_tokens=900, ignore_eos=True))
        with pytest.raises(InvalidRequest, match="already running"):
            await collect(eng, req("dup", max_tokens=2))
        eng.cancel("dup")
        return got + [d async for d in first]
    assert run(duplicate())[-1].finish_reason == "cancelled"
    s = wait_idle(eng)
    assert s.requests["refused_invalid"] == before + 1
    assert s.requests["refused_overloaded"] == 0     # every series exists from the start


def test_eos_finishes_with_stop_and_is_not_decoded(eng):
    """This prompt's greedy continuation reaches the tokenizer's EOS (id 0) at the 6th token."""
    deltas = run(collect(eng, req("eos", n_prompt=21, pseed=1, max_tokens=32)))
    assert deltas[-1].finish_reason == "stop" and tokens(deltas)[-1] == 0
    assert len(tokens(deltas)) == 6 and deltas[-1].usage.completion_tokens == 6
    assert deltas[-1].text == ""
    ignored = run(collect(eng, req("ign", n_prompt=21, pseed=1, max_tokens=8, ignore_eos=True)))
    assert ignored[-1].finish_reason == "length" and len(tokens(ignored)) == 8
    wait_idle(eng)


def test_a_consumer_that_falls_behind_gets_merged_deltas_with_every_token(eng):
    """coalesce=True: deltas already queued when the consumer reads are handed over as one."""
    want = run(collect(eng, req("one-by-one", n_prompt=9, pseed=8, max_tokens=20,
                                ignore_eos=True)))

    async def slow_reader():
        before = eng.stats().requests["finished_length"]
        agen = eng.generate(req("merged", n_prompt=9, pseed=8, max_tokens=20, ignore_eos=True),
                            coalesce=True)
        out = [await agen.__anext__()]
        # Fall behind on purpose: read on only once the engine reports the request finished
        # (a condition, not a clock). Every non-final delta is queued by then.
        while eng.stats().requests["finished_length"] < before + 1:
            await asyncio.sleep(0.01)
        return out + [d async for d in agen]
    got = run(slow_reader())
    assert tokens(got) == tokens(want) and "".join(d.text for d in got) == \
        "".join(d.text for d in want)
    # The first delta, the rest merged (the final one may still have been in flight).
    assert 2 <= len(got) <= 3 and got[-1].finish_reason == "length"
    assert got[0].ttft_s is not None and got[-1].usage.completion_tokens == 20
