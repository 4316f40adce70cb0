"""Per-row sampler options (engine/sampling/sampler.py): logit_bias, penalties, min_p, logprobs and
stop token ids, each applied to its own row inside one batched call; rows without options
are untouched; in the engine, a batch mixing options gives each request its solo output."""
import asyncio
import math

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import InvalidRequest
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RowSpec, StepLogprobs, process_logits, sample
from tests.engine_helpers import collect, make_engine, prompt, tokens

V = 32


def _logits(rows=3, seed=0):
    return mx.random.normal((rows, V), key=mx.random.key(seed)) * 3


def test_logit_bias_moves_its_row_only():
    logits = _logits()
    plain = SamplingParams(temperature=0)
    biased = SamplingParams(temperature=0, logit_bias=((7, 100.0),))
    got = sample(logits, [RowSpec(plain, 0, 0), RowSpec(biased, 0, 0), RowSpec(plain, 0, 0)])
    want = mx.argmax(logits, axis=-1).tolist()
    assert got.tolist() == [want[0], 7, want[2]]
    banned = SamplingParams(temperature=0, logit_bias=((want[1], -100.0),))
    assert sample(logits[1:2], [RowSpec(banned, 0, 0)]).item() != want[1]


def test_penalties_follow_their_definitions_exactly():
    logits = _logits(rows=2)
    prompt_ids, out = [1, 2], [3, 3, 5, 2]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    rows = [RowSpec(SamplingParams(), 0, 0), RowSpec(p, 0, 4, prompt_ids, out)]
    got = np.array(process_logits(logits, rows))
    raw = np.array(logits)
    assert np.array_equal(got[0], raw[0])      # a row without options is untouched
    want = raw[1].copy()
    for t in {1, 2, 3, 5}:                     # repetition: prompt and output tokens
        want[t] = want[t] * 1.3 if want[t] < 0 else want[t] / 1.3
    for t, count in {3: 2, 5: 1, 2: 1}.items():   # frequency and presence: output tokens
        want[t] -= 0.25 * count + 0.5
    np.testing.assert_allclose(got[1], want, rtol=1e-6, atol=1e-6)


def test_min_p_restricts_support_to_its_row():
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, min_p=0.4)   # keeps p >= 0.2: tokens 0 and 1
    drawn = {sample(logits, [RowSpec(p, 9, i)]).item() for i in range(300)}
    assert drawn == {0, 1}
    free = {sample(logits, [RowSpec(SamplingParams(temperature=1.0), 9, i)]).item()
            for i in range(300)}
    assert free == {0, 1, 2, 3}


def test_logprobs_are_the_model_distribution_per_row():
    logits = _logits()
    rows = [RowSpec(SamplingParams(temperature=0, logprobs=3), 0, 0),
            RowSpec(SamplingParams(temperature=0), 0, 0),
            RowSpec(SamplingParams(temperature=0, logprobs=0,
                                   logit_bias=((4, 50.0),)), 0, 0)]
    tokens = sample(logits, rows)
    lp = StepLogprobs(logits, tokens, rows)
    mx.eval(tokens, *lp.arrays)
    by_row = lp.by_row()
    assert set(by_row) == {0, 2}
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    first = by_row[0]
    assert math.isclose(first.logprob, ref[0].max(), abs_tol=1e-5)
    assert [t for t, _ in first.top] == list(np.argsort(-ref[0])[:3])
    # Biased row: token 4 is picked, its logprob is the model's own (before the bias).
    assert tokens.tolist()[2] == 4 and by_row[2].top == ()
    assert math.isclose(by_row[2].logprob, ref[2][4], abs_tol=1e-5)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0), dict(min_p=-0.1),
                                 dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)),
                                 dict(logit_bias=((1, 1.0), (1, 2.0))),
                                 dict(stop_token_ids=(-3,)), dict(logprobs=21)])
def test_bad_options_are_invalid_requests(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def eng(tiny_llama):
    e = make_engine(tiny_llama, pages=64, max_step_tokens=48)
    yield e
    e.shutdown()


def test_mixed_batch_gives_each_request_its_solo_output(eng):
    """Four requests at once, each with other options: every one equals its run alone, and
    logprobs come one per token."""
    opts = {"plain": dict(temperature=0),
            "biased": dict(temperature=0, logit_bias=((9, 4.0),)),
            "penalized": dict(temperature=0.8, seed=3, frequency_penalty=1.5,
                              repetition_penalty=1.2),
            "logprobs": dict(temperature=0.7, seed=5, logprobs=2, min_p=0.05)}

    def request(name, tag):
        return GenerationRequest(f"{name}-{tag}", prompt(12, 1),
                                 SamplingParams(max_tokens=10, ignore_eos=True, **opts[name]))

    async def together():
        return await asyncio.gather(*(collect(eng, request(n, "batch")) for n in opts))

    batch = dict(zip(opts, asyncio.run(together())))
    for name in opts:
        alone = asyncio.run(collect(eng, request(name, "alone")))
        assert tokens(batch[name]) == tokens(alone), name
    lps = [e for d in batch["logprobs"] for e in (d.logprobs or [])]
    assert len(lps) == len(tokens(batch["logprobs"])) == 10
    assert all(len(e.top) == 2 and e.logprob <= 0 for e in lps)
    assert all(d.logprobs is None for d in batch["plain"])


def test_stop_token_ids_finish_with_stop(eng):
    def request(rid, **kw):
        return GenerationRequest(rid, prompt(8, 2), SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, **kw))

    ids = tokens(asyncio.run(collect(eng, request("free"))))
    stopped = asyncio.run(collect(eng, request("stopped", stop_token_ids=(ids[3],))))
    k = ids.index(ids[3])
    assert tokens(stopped) == ids[:k + 1] and stopped[-1].finish_reason == "stop"


def test_bitmask_applies_exactly_the_allowed_tokens():
    from engine.sampling.logits_processors import MASKED, apply_bitmask

    rng = np.random.default_rng(1)
    vocab = 70   # not a multiple of 32: the last word is partly padding
    mask = rng.integers(-2**31, 2**31 - 1, (3, 3), dtype=np.int64).astype(np.int32)
    logits = mx.random.normal((3, vocab), key=mx.random.key(2))
    got = np.array(apply_bitmask(logits, mask))
    allowed = np.array([[(int(mask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
                        for r in range(3)], dtype=bool)
    raw = np.array(logits)
    assert np.array_equal(got[allowed], raw[allowed])
    assert np.all(got[~allowed] <= MASKED / 2)


def test_rows_that_skip_the_sort_draw_as_in_a_sorted_batch():
    """A temperature-only row skips the sort when alone, and rides along when a top-k row makes
    the batch sort: the same seed gives the same tokens both ways."""
    logits = _logits(rows=2)
    plain = SamplingParams(temperature=0.9, min_p=0.01)
    alone = [sample(logits[0:1], [RowSpec(plain, 4, i)]).item() for i in range(60)]
    sorted_batch = [sample(logits, [RowSpec(plain, 4, i), RowSpec(SamplingParams(top_k=5), 1, i)]
                           ).tolist()[0] for i in range(60)]
    assert alone == sorted_batch and len(set(alone)) > 3
