"""The text suite's margin rule (quality.verdicts.MIN_MARGIN_NATS) and its retrieval task.

A graded case is judged only where native's answer beats the runner-up by the declared margin at
every position; native's own margin comes from graded_spans. Checked here: the margin's value
against a plain forward pass, that the gate judges exactly the selected cases (a near-tie lost by
a format does not count, a clear answer lost does), and that the retrieval task asks for what the
dict holds, with its demonstration lines given and not graded.
"""
from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
import pytest

from engine.model.loader import load_model
from quality import gate as quality
from quality.runs import REF, REF_MARGIN, _tables, forced_margin, graded_spans, make_runner
from quality.tasks import RETRIEVAL_TASK, Spans, _enc, retrieval_sequences
from quality.verdicts import MIN_MARGIN_NATS, RETRIEVAL_NATIVE_MIN
from tests.quality.test_text_suite import _greedy


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return load_model(tiny_model_dirs["llama"])


def test_forced_margin_is_the_log_prob_gap_to_the_runner_up():
    logits = mx.array([[0.0, 2.0, 1.0], [3.0, 1.0, 3.0], [0.0, 2.0, 1.0]])
    got = forced_margin(logits, mx.array([1, 0, 2])).tolist()
    # right by 1; a tie (0: not a unique argmax); wrong by 1 (negative)
    assert got == pytest.approx([1.0, 0.0, -1.0])
    # equal to the gap of log-probabilities (one shared normalizer)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert got[0] == pytest.approx((lp[0, 1] - lp[0, 2]).item(), abs=1e-6)


def test_graded_spans_margin_matches_a_plain_forward(llama):
    rng = np.random.default_rng(3)
    seqs = []
    for i in range(3):
        s = Spans([])
        prompt = [int(t) for t in rng.integers(3, 200, 30 + 7 * i)]
        s.add(prompt)
        s.add(_greedy(llama, prompt, 4), "a")   # what the model produces: a positive margin
        s.add([int(t) for t in rng.integers(3, 200, 9)])
        s.add([int(t) for t in rng.integers(3, 200, 3)], "b")
        seqs.append(s)
    got = graded_spans(llama, seqs, [], chunk=16, batch=2)
    margins = got[REF_MARGIN]
    assert margins.shape == (6,)
    want = []
    for s in seqs:
        pages, tables = _tables(1, len(s.tokens))
        from engine.sched.seq import Chunk
        logits = make_runner(llama, "native", pages).forward_all(
            [Chunk(0, s.tokens, 0, tables[0])])[0]
        per_pos = np.array(forced_margin(logits[:-1], mx.array(s.tokens[1:])))
        want += [float(per_pos[a - 1:b - 1].min()) for a, b in s.spans]
    np.testing.assert_allclose(margins, want, atol=2e-3)
    # positive margin exactly where the reference reproduces the span
    assert ((margins > 0) == (got[REF] == 1)).all()
    assert got[REF].tolist() == [1, 0] * 3


def test_selection_drops_near_ties_and_native_misses():
    got = {REF: np.array([1, 1, 1, 0, 1], np.int8),
           REF_MARGIN: np.array([3.0, MIN_MARGIN_NATS, MIN_MARGIN_NATS / 2, -1.0, 0.01],
                                np.float32)}
    assert quality.select_by_margin(got).tolist() == [True, True, False, False, False]
    assert 0 < MIN_MARGIN_NATS < 5   # a declared value, not a tuned-away check


def _ns(**kw):
    base = dict(formats=["native", "int8"], retrieval_chunk=512, batch=4, probes=4,
                lengths=[512], retrieval_cases=6)
    base.update(kw)
    return argparse.Namespace(**base)


def _fake_spans(monkeypatch, ref, margin, fmt_ok):
    from quality import runs
    seen = {}

    def fake(loaded, seqs, formats, chunk, batch, log=None, make=None):
        n = sum(len(s.spans) for s in seqs)
        seen["n"] = n
        return {REF: np.asarray(ref[:n], np.int8), "native": np.asarray(ref[:n], np.int8),
                "int8": np.asarray(fmt_ok[:n], np.int8),
                REF_MARGIN: np.asarray(margin[:n], np.float32)}
    monkeypatch.setattr(runs, "graded_spans", fake)
    return seen


def test_probes_judge_only_cases_native_wins_by_the_margin(llama, monkeypatch):
    # 8 candidates for 4 probes (PROBE_ASK 2): native right on 7, 2 of those near-ties.
    ref = [1, 1, 1, 1, 1, 1, 1, 0]
    margin = [2.0, 0.1, 3.0, 0.2, 4.0, 5.0, 6.0, -1.0]
    # int8 loses both near-ties (any rounding can flip them): not judged, so no loss counted.
    fmt_ok = [1, 0, 1, 0, 1, 1, 1, 0]
    seen = _fake_spans(monkeypatch, ref, margin, fmt_ok)
    out = quality.run_probes_text(llama, None, _ns())
    assert seen["n"] == int(quality.PROBE_ASK * 4)
    assert out["kept"] == 4 and out["native_correct"] == 7
    assert out["by_format"]["int8"]["delta_points"]["estimate"] == 0.0
    assert out["by_format"]["int8"]["cases"] == 4
    # the earlier rule (every native-correct probe) would have counted both losses
    assert out["native_correct_rule"]["int8"]["delta_points"]["estimate"] == -50.0
    assert sorted(out["lost_margins"]["int8"]) == pytest.approx([0.1, 0.2])
    assert out["min_margin_nats"] == MIN_MARGIN_NATS
    # a loss on a clear answer counts
    fmt_ok[0] = 0
    _fake_spans(monkeypatch, ref, margin, fmt_ok)
    out = quality.run_probes_text(llama, None, _ns())
    assert out["by_format"]["int8"]["delta_points"]["estimate"] == -25.0


def test_retrieval_judges_selected_cases_and_reports_native_on_all(llama, monkeypatch):
    per_seq = RETRIEVAL_TASK["facts"] - RETRIEVAL_TASK["demos"]
    n = 2 * per_seq
    ref = [1] * n
    ref[0] = 0
    margin = [2.0] * n
    margin[0], margin[1] = -0.5, 0.1
    fmt_ok = list(ref)
    fmt_ok[1] = 0            # a near-tie lost: not judged
    _fake_spans(monkeypatch, ref, margin, fmt_ok)
    code = np.arange(3, 5000) % 250
    monkeypatch.setattr("quality.data.code_stream", lambda tok: code)
    out = quality.run_retrieval_text(llama, None, _ns(retrieval_cases=n))
    cell = out["int8"]["by_length"]["512"]
    assert cell["cases"] == n - 2 and cell["delta_points"]["estimate"] == 0.0
    assert cell["native_accuracy_all"] == pytest.approx((n - 1) / n)
    assert cell["native_at_least"] == RETRIEVAL_NATIVE_MIN
    assert cell["all_cases"]["cases"] == n and cell["all_cases"]["delta_points"]["estimate"] < 0


def test_retrieval_task_copies_the_dict_with_given_demonstrations(llama):
    tok = llama.tokenizer
    assert RETRIEVAL_TASK["style"] == "copy" and RETRIEVAL_TASK["demos"] >= 1
    code = np.array(_enc(tok, "x = 1\n    y = 2\n" * 400))
    seqs = retrieval_sequences(tok, code, 512, 13, **RETRIEVAL_TASK)
    graded = RETRIEVAL_TASK["facts"] - RETRIEVAL_TASK["demos"]
    assert len(seqs) == -(-13 // graded)
    for s in seqs:
        assert len(s.tokens) <= 512 + 1 and len(s.spans) == graded
        text = tok.decode(s.tokens)
        table, backup = text.split("BACKUP = {\n")
        lines = [ln for ln in backup.splitlines() if ln.startswith('    "')]
        assert len(lines) == RETRIEVAL_TASK["facts"]
        for ln in lines:     # every copied line is the dict's own line
            assert ln in table.splitlines()
        # graded: the value of each of the last `graded` lines, digits only
        answers = [tok.decode(s.tokens[a:b]) for a, b in s.spans]
        assert answers == [ln.split('": "')[1].rstrip('",') for ln in lines[-graded:]]
        assert all(a.isdigit() and len(a) == RETRIEVAL_TASK["digits"] for a in answers)
        # the demonstrations precede every graded span
        first = s.spans[0][0]
        assert tok.decode(s.tokens[:first]).count("BACKUP") == 1
        assert tok.decode(s.tokens[:first]).split("BACKUP = {\n")[1].count('": "') == \
            RETRIEVAL_TASK["demos"] + 1


def test_text_presets_have_cases_for_a_decision():
    a = quality.resolve_sizes(quality.build_parser().parse_args(["--model", "models/smollm2-135m"]))
    assert a.suite == "text" and a.lengths == [512]
    # a 0-loss pass needs ~185 judged cases; about 8 in 10 candidates pass the margin rule
    assert a.retrieval_cases * 0.75 >= 180 and a.probes >= 185


def test_a_retrieval_task_native_is_bad_at_cannot_pass_a_format():
    from quality.verdicts import verdicts
    cell = {"accuracy": 1.0, "native_accuracy": 1.0, "cases": 300,
            "delta_points": {"estimate": 0.0, "ci95": [-1.2, 1.2]}, "native_accuracy_all": 0.95}
    result = {"formats": ["int8"], "nll": {}, "probes": {},
              "retrieval": {"int8": {"by_length": {"512": cell}}}}
    assert verdicts(result)["int8"]["checks"][0]["verdict"] == "pass"
    cell["native_accuracy_all"] = RETRIEVAL_NATIVE_MIN - 0.01
    assert verdicts(result)["int8"]["checks"][0]["verdict"] == "inconclusive"
    # a clear loss still fails
    cell["delta_points"] = {"estimate": -10.0, "ci95": [-14.0, -6.0]}
    assert verdicts(result)["int8"]["checks"][0]["verdict"] == "fail"
