"""min_tokens (vLLM's extension): the tokens that would end a sequence (EOS, stop_token_ids)
are masked until that many were generated; stop strings count only after them. The real
sampler, and the real Engine on the tiny llama, whose greedy continuation of this prompt reaches
EOS (id 0) at its 6th token (tests/engine/test_generate.py)."""
import asyncio

import mlx.core as mx
import pytest

from engine.errors import InvalidRequest
from engine.sampling.detok import TextStream
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RowSpec, sample
from tests.engine_helpers import collect, make_engine, req, run, tokens, wait_idle

EOS = 0
PROMPT = dict(n_prompt=21, pseed=1)   # greedy: EOS as the 6th token


@pytest.fixture(scope="module")
def eng(tiny_llama):
    e = make_engine(tiny_llama, pages=64, max_step_tokens=48)
    yield e
    e.shutdown()


def test_params_validate_min_tokens():
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    for bad in (-1, 5, 1.5, True):
        with pytest.raises(InvalidRequest, match="min_tokens"):
            SamplingParams(max_tokens=4, min_tokens=bad)
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=2, grammar="start: \"a\"")
    p = SamplingParams(max_tokens=8, min_tokens=3, eos_token_ids=(0, 2), stop_token_ids=(7, 2))
    assert p.held_back_ids == (0, 2, 7)
    assert SamplingParams(max_tokens=8, min_tokens=3, eos_token_ids=(0,), stop_token_ids=(7,),
                          ignore_eos=True).held_back_ids == (7,)   # EOS does not end it anyway
    assert SamplingParams(max_tokens=8, eos_token_ids=(0,)).held_back_ids == ()


def test_sampler_masks_ending_tokens_only_before_min_tokens():
    """Row 0 (greedy) and row 1 (sampled) both have EOS as by far the likeliest token; row 2
    has no min_tokens and is untouched. Past min_tokens EOS comes back."""
    logits = mx.zeros((3, 16))
    logits = logits.at[:, EOS].add(50.0).at[:, 5].add(10.0)
    held = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, eos_token_ids=(EOS,))
    hot = SamplingParams(temperature=1.0, max_tokens=8, min_tokens=3, eos_token_ids=(EOS,))
    free = SamplingParams(temperature=0.0, max_tokens=8)
    before = sample(logits, [RowSpec(held, 1, 2), RowSpec(hot, 1, 0), RowSpec(free, 1, 0)])
    assert before.tolist() == [5, 5, EOS]
    after = sample(logits, [RowSpec(held, 1, 3), RowSpec(hot, 1, 3), RowSpec(free, 1, 0)])
    assert after.tolist() == [EOS, EOS, EOS]


def test_min_tokens_generates_past_eos(eng):
    plain = tokens(run(collect(eng, req("plain", **PROMPT, max_tokens=32))))
    assert plain[-1] == EOS and len(plain) == 6
    deltas = run(collect(eng, req("min", **PROMPT, max_tokens=32, min_tokens=12)))
    got = tokens(deltas)
    assert len(got) >= 12 and EOS not in got[:12]
    assert got[:5] == plain[:5]          # nothing changes before the first held-back EOS
    assert deltas[-1].usage.completion_tokens == len(got)
    assert deltas[-1].finish_reason == ("stop" if got[-1] == EOS else "length")
    # min_tokens == max_tokens: exactly that many, ending on length.
    exact = run(collect(eng, req("exact", **PROMPT, max_tokens=9, min_tokens=9)))
    assert len(tokens(exact)) == 9 and exact[-1].finish_reason == "length"
    wait_idle(eng)


def test_min_tokens_holds_back_stop_token_ids_and_is_the_same_batched(eng):
    """A stop token id sampled at index 2 alone ends the request there; with min_tokens=8 it
    may not, and the row gets the same tokens next to another request (pipelined decode keeps
    each row's token index exact)."""
    plain = tokens(run(collect(eng, req("p", **PROMPT, max_tokens=32))))
    stop_id = plain[2]
    stopped = tokens(run(collect(eng, req("s", **PROMPT, max_tokens=32,
                                          stop_token_ids=[stop_id]))))
    assert stopped == plain[:3]
    held = dict(**PROMPT, max_tokens=16, min_tokens=8, stop_token_ids=[stop_id])
    alone = tokens(run(collect(eng, req("h", **held))))
    assert len(alone) >= 8 and stop_id not in alone[:8] and EOS not in alone[:8]

    async def batched():
        return await asyncio.gather(
            collect(eng, req("other", n_prompt=30, pseed=6, max_tokens=20, ignore_eos=True)),
            collect(eng, req("h2", **held)))
    _, together = run(batched())
    assert tokens(together) == alone
    wait_idle(eng)


class _Chars:
    """A tokenizer whose token i is the character chr(ord('a') + i): text is easy to reason on."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_stop_strings_count_only_after_min_tokens():
    a, b = 0, 1
    early = TextStream(_Chars(), [], stop=("ab",))
    assert early.push(a) == "" and early.push(b) == "" and early.stopped
    late = TextStream(_Chars(), [], stop=("ab",), min_tokens=2)
    assert late.push(a) == "a" and late.push(b) == "b" and not late.stopped
    assert late.push(a) == "" and late.push(b) == "" and late.stopped   # matched after
