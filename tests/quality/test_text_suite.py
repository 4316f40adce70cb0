"""The quality gate's text suite (quality.tasks, graded_spans) on a tiny model.

The suite's claim is that grading a span teacher-forced is exactly "greedy decoding from the
span's start reproduces it": checked here against the gate's own greedy decoder on spans the
model does produce and on spans it does not. The real-model run is `make quality` (SmolLM2).
"""
from __future__ import annotations

import numpy as np
import pytest

from capacity.formats import KVFormat
from engine.model.loader import load_model
from quality.data import Case
from quality.runs import _cuts, generate, graded_spans
from quality.tasks import Spans, probe_conversations, retrieval_sequences
from quality.variants import VARIANTS


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return load_model(tiny_model_dirs["llama"])


def _greedy(loaded, prompt, n):
    """The model's own greedy continuation of `prompt` (native, one token per step)."""
    from quality.runs import make_runner, _tables
    from engine.sched.seq import Chunk
    import mlx.core as mx
    pages, tables = _tables(1, len(prompt) + n)
    r = make_runner(loaded, "native", pages)
    out, pos, ids = [], 0, list(prompt)
    while len(out) < n:
        logits = r.forward([Chunk(0, ids, pos, tables[0])])
        pos += len(ids)
        out.append(int(mx.argmax(logits[0]).item()))
        ids = [out[-1]]
    return out


@pytest.mark.parametrize("fmt", ["native", "int4"])
def test_graded_span_equals_greedy_decoding(llama, fmt):
    rng = np.random.default_rng(0)
    seqs, cases = [], []
    for i in range(3):
        prompt = [int(t) for t in rng.integers(3, 200, 40 + 17 * i)]
        own = _greedy(llama, prompt, 6)
        wrong = list(own)
        wrong[3] = (wrong[3] + 1) % 200   # greedy gets the first 3 right, then not this one
        s = Spans([])
        s.add(prompt)
        s.add(own, "own")
        s.add([5, 6, 7])
        s.add(prompt[:9])
        s.add(wrong, "wrong")
        seqs.append(s)
        mid = len(prompt) + 6 + 3 + 9
        cases += [Case("own", 0, prompt, own), Case("wrong", 0, s.tokens[:mid], wrong)]
    got = graded_spans(llama, seqs, [fmt], chunk=16, batch=2)
    want = generate(llama, fmt, cases, chunk=16, batch=2)
    assert got[fmt].tolist() == want.tolist()
    if fmt == "native":
        assert got[fmt].tolist() == [1, 0] * 3
        assert got["__reference__"].tolist() == [1, 0] * 3


def test_cuts_put_each_answer_context_in_history():
    s = Spans(list(range(100)))
    s.spans = [(40, 44), (70, 75)]
    assert _cuts(s, 32) == [(0, 32), (32, 39), (39, 64), (64, 69), (69, 96), (96, 100)]


def test_tasks_are_well_formed(llama):
    code = np.arange(3, 3000) % 250
    seqs = retrieval_sequences(llama.tokenizer, code, 3000, 16)
    assert len(seqs) == 2
    for s in seqs:
        assert len(s.tokens) == 3000 + 1   # the target length plus the newline after the filler
        assert len(s.spans) == 8 and len({tuple(s.tokens[a:b]) for a, b in s.spans}) > 1
    with pytest.raises(ValueError):
        retrieval_sequences(llama.tokenizer, code, 64, 8)
    convs = probe_conversations(llama.tokenizer, 10, turns=4)
    assert sum(len(c.spans) for c in convs) == 10 and len(convs) == 3
    fams = [f for c in convs for f in c.families]
    assert set(fams) == {"chat_passkey", "chat_lookup", "chat_repeat"}


def test_variant_bytes_match_the_format_registry():
    """The experiment's byte arithmetic agrees with capacity.formats where both exist."""
    for name, fmt in (("int4", "int4"), ("int8", "int8"), ("int4-kg32", "int4-k32")):
        want = KVFormat(fmt, 64, "bfloat16").bytes_per_token(1)
        assert VARIANTS[name].row_bytes(64, 64, 1024) == want
