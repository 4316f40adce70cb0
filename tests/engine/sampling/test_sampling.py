"""Sampler (greedy, temperature, top-k, top-p, per-request seeds) and stop-string detokenization."""
import math

import mlx.core as mx
import numpy as np
import pytest

from engine.sampling.detok import TextStream
from engine.errors import InvalidRequest
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import RowSpec, sample
from bench.synthetic import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return load(d)


# Every sampling test runs both draws: MLX's Gumbel noise (GPUs) and the host draw CPU steps
# take (engine/sampling/sampler.py `_draw_host`); they pick different tokens for a seed, from
# the same distribution.
HOSTS = pytest.mark.parametrize("host", [False, True], ids=["mlx_draw", "host_draw"])


def draw(host: bool):
    return lambda logits, rows: sample(logits, rows, host)


def _logits(rows=4, vocab=64, seed=0):
    return mx.random.normal((rows, vocab), key=mx.random.key(seed))


def test_greedy_is_argmax():
    logits = _logits()
    rows = [RowSpec(SamplingParams(temperature=0), 1, 0)] * 4
    assert sample(logits, rows).tolist() == mx.argmax(logits, axis=-1).tolist()


@HOSTS
def test_seeded_row_is_independent_of_batch_composition(host):
    logits = _logits(rows=3)
    p = SamplingParams(temperature=1.0)
    alone = [draw(host)(logits[1:2], [RowSpec(p, 42, i)]).item() for i in range(20)]
    batched = [draw(host)(logits, [RowSpec(SamplingParams(temperature=0), 0, 0),
                                   RowSpec(p, 42, i),
                                   RowSpec(SamplingParams(temperature=0.5), 7, i)]).tolist()[1]
               for i in range(20)]
    assert alone == batched
    other_seed = [draw(host)(logits[1:2], [RowSpec(p, 43, i)]).item() for i in range(20)]
    assert other_seed != alone


@HOSTS
def test_top_k_and_top_p_restrict_the_support(host):
    logits = _logits(rows=1, vocab=32)
    order = mx.argsort(-logits[0]).tolist()
    k3 = {draw(host)(logits, [RowSpec(SamplingParams(top_k=3), 5, i)]).item() for i in range(200)}
    assert k3 <= set(order[:3]) and len(k3) > 1
    probs = mx.softmax(logits[0]).tolist()
    sorted_p = sorted(probs, reverse=True)
    nucleus = next(i for i in range(32) if sum(sorted_p[:i + 1]) >= 0.5) + 1
    p5 = {draw(host)(logits, [RowSpec(SamplingParams(top_p=0.5), 5, i)]).item()
          for i in range(200)}
    assert p5 <= set(order[:nucleus])
    tiny = {draw(host)(logits, [RowSpec(SamplingParams(top_p=1e-6), 5, i)]).item()
            for i in range(20)}
    assert tiny == {order[0]}


def _kept_reference(logits_row: np.ndarray, temperature: float, top_k: int, top_p: float) -> set:
    """The textbook top-k/top-p support in float64: sort everything, keep the k best, and the
    shortest sorted prefix whose mass reaches top_p."""
    scaled = logits_row.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    n = max(int(np.sum(before < top_p)), 1) if top_p < 1 else len(order)
    return set(order[:min(n, top_k or len(order))].tolist())


@pytest.mark.parametrize("params", [dict(temperature=0.8, top_k=50, top_p=0.95),
                                    dict(temperature=1.0, top_k=20),
                                    dict(temperature=1.5, top_k=200, top_p=0.3)])
@HOSTS
def test_top_k_rows_draw_the_same_tokens_without_sorting_the_vocabulary(params, host):
    """A batch whose ranking rows all have a top_k ranks a partitioned candidate set; a top-p
    row without top_k in the batch makes it sort the whole vocabulary. A seeded row's token
    must not depend on which path its batch took, and must lie in the textbook support."""
    vocab = 4096
    logits = mx.random.normal((8, vocab), key=mx.random.key(3)) * 4
    sorts_all = RowSpec(SamplingParams(temperature=0.7, top_p=0.9), 1, 0)
    for i in range(25):
        rows = [RowSpec(SamplingParams(**params), 100 + r, i) for r in range(8)]
        fast = draw(host)(logits, rows).tolist()
        for r in range(8):
            full = draw(host)(logits[r:r + 1], [rows[r]]), draw(host)(
                mx.concatenate([logits[r:r + 1], logits[:1]]), [rows[r], sorts_all])
            assert full[1].tolist()[0] == fast[r], (params, i, r)
            kept = _kept_reference(np.array(logits[r]), params["temperature"],
                                   params.get("top_k", 0), params.get("top_p", 1.0))
            assert fast[r] in kept and full[0].item() == fast[r]


@HOSTS
def test_top_k_caps_a_long_nucleus_and_top_p_cuts_inside_top_k(host):
    logits = mx.random.normal((1, 2048), key=mx.random.key(9))   # flat: a long nucleus
    order = np.argsort(-np.array(logits[0]), kind="stable").tolist()
    k10 = {draw(host)(logits, [RowSpec(SamplingParams(top_k=10, top_p=0.99), 4, i)]).item()
           for i in range(300)}
    assert k10 == set(order[:10])      # top_k decides: every one of the 10 gets drawn
    # The same beside a row with a larger top_k (the candidate set is the batch's largest k).
    pair = mx.concatenate([logits, logits])
    k10 = {draw(host)(pair, [RowSpec(SamplingParams(top_k=10), 4, i),
                         RowSpec(SamplingParams(top_k=60), 5, i)]).tolist()[0]
           for i in range(300)}
    assert k10 == set(order[:10])
    peaked = logits * 40
    cut = {draw(host)(peaked, [RowSpec(SamplingParams(top_k=100, top_p=0.5), 4, i)]).item()
           for i in range(100)}
    assert cut <= _kept_reference(np.array(peaked[0]), 1.0, 100, 0.5) and len(cut) < 100


@HOSTS
def test_temperature_one_matches_softmax_frequencies(host):
    logits = mx.array([[2.0, 1.0, 0.0, -1.0]])
    n = 3000
    draws = [draw(host)(logits, [RowSpec(SamplingParams(), 11, i)]).item() for i in range(n)]
    probs = mx.softmax(logits[0]).tolist()
    for tok, p in enumerate(probs):
        freq = draws.count(tok) / n
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-1),
                                 dict(max_tokens=0), dict(stop=("",)), dict(seed="x")])
def test_bad_params_are_invalid_requests(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad)


def _stream(tokenizer, text, stop=()):
    ids = tokenizer.encode(text)
    ts = TextStream(tokenizer, [1, 2], stop)
    pieces = [ts.push(t) for t in ids]
    return pieces, ts


def test_incremental_text_equals_full_decode_and_never_splits_characters(tokenizer):
    text = "Hello, world! é ü 日本 The end."
    pieces, ts = _stream(tokenizer, text)
    pieces.append(ts.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_is_never_emitted_and_partials_are_held(tokenizer):
    pieces, ts = _stream(tokenizer, "Hello, world! Stop here. The end.", stop=("Stop here",))
    assert ts.stopped and "".join(pieces) == "Hello, world! "
    assert ts.flush() == ""
    # "Stop" starts a match of "Stop now" but diverges: it is held, then released intact.
    pieces, ts = _stream(tokenizer, "Hello, world! Stop here. The end.", stop=("Stop now",))
    assert not ts.stopped
    seen = ""
    for p in pieces:
        seen += p
        assert not seen.endswith("Stop") and not seen.endswith("Sto")
    assert seen + ts.flush() == "Hello, world! Stop here. The end."


def test_earliest_of_several_stop_strings_wins(tokenizer):
    pieces, ts = _stream(tokenizer, "The quick brown fox jumps", stop=("fox", "quick"))
    assert "".join(pieces) == "The "
