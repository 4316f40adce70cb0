"""The KV-format quality gate (quality.gate) on the shipped model, reduced to CI size.

Substance, not just shape: native against itself must be exactly zero (the harness adds no noise
of its own), int8 must differ from native by a small positive KL, the no-rotation ablation must
really store unrotated keys yet attend like the rotated path, and the verdict rule must decide
hand-made intervals the declared way.
"""
from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from quality import gate as quality
from quality import options
from quality.stats import (FAIL, INCONCLUSIVE, PASS, Interval, accuracy_delta_interval,
                                  combine, relative_delta_interval, verdict_at_most,
                                  verdict_within_points)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality")
    argv = ["--quick", "--formats", "native,int8", "--data", str(ROOT / "training" / "data"),
            "--window", "256", "--chunk", "64", "--nll-tokens", "300", "--retrieval-cases", "2",
            "--lengths", "512", "--probes", "4", "--batch", "4",
            "--out", str(out / "q.json"), "--md", str(out / "q.md")]
    assert quality.main(argv) == 0
    return json.loads((out / "q.json").read_text()), (out / "q.md").read_text()


def test_native_control_is_exactly_zero(gate):
    r, _ = gate
    n = r["nll"]["native"]
    assert n["nll_delta_pct"] == {"estimate": 0.0, "ci95": [0.0, 0.0]}
    assert n["kl"] == {"estimate": 0.0, "ci95": [0.0, 0.0]}
    assert n["top1_agreement"]["estimate"] == 1.0 and n["top1_agreement"]["ci95"] == [1.0, 1.0]
    assert n["native_nll"] == n["format_nll"]
    # 2 windows of 256, first 64-token chunk unscored: 2 x (255 - 64) predictions.
    assert n["tokens"] == 2 * (256 - 1 - 64) and n["windows"] == 2
    # a sane held-out loss (random weights give ~9 nats/token)
    assert 0.5 < n["native_nll"] < 3.5


def test_int8_is_close_but_not_identical(gate):
    r, _ = gate
    i8 = r["nll"]["int8"]
    assert 0.0 < i8["kl"]["estimate"] < 1e-3
    assert i8["kl"]["ci95"][0] > 0.0
    assert 0.97 <= i8["top1_agreement"]["estimate"] <= 1.0
    assert abs(i8["nll_delta_pct"]["estimate"]) < 0.5
    assert i8["format_nll"] != i8["native_nll"]
    lo, hi = i8["nll_delta_pct"]["ci95"]
    assert lo <= i8["nll_delta_pct"]["estimate"] <= hi


def test_retrieval_probes_and_verdicts(gate):
    r, md = gate
    cell = r["retrieval"]["int8"]["by_length"]["512"]
    assert cell["cases"] == 4 and cell["native_accuracy"] == 1.0   # 2 pass-key + 2 key-value
    assert set(r["retrieval"]["int8"]["cells"]) == {"passkey@512", "kv@512"}
    assert r["probes"]["kept"] == 4 and r["probes"]["by_format"]["native"]["accuracy"] == 1.0
    assert set(r["verdicts"]) == {"int8"}
    checks = {c["check"]: c for c in r["verdicts"]["int8"]["checks"]}
    assert set(checks) == {"nll_delta_pct <= 0.1", "kl <= 0.001", "retrieval@512 within 2 points",
                           "probes within 2 points"}
    assert checks["kl <= 0.001"]["verdict"] == PASS      # KL ~1e-5 with a tight interval
    assert r["verdicts"]["int8"]["overall"] == combine([c["verdict"] for c in checks.values()])
    assert r["dtype"] == "float32" and r["sizes"]["chunk"] == 64
    assert "| int8 |" in md and "python -m quality.gate --quick" in md
    assert "chunks of 64 tokens" in md


def test_verdict_rule_on_hand_made_intervals():
    m = 0.1
    assert verdict_at_most(Interval(0.02, -0.01, 0.08), m) == PASS
    assert verdict_at_most(Interval(0.1, 0.05, 0.1), m) == PASS          # bound on the margin
    assert verdict_at_most(Interval(0.3, 0.2, 0.4), m) == FAIL
    assert verdict_at_most(Interval(0.09, 0.01, 0.15), m) == INCONCLUSIVE
    assert verdict_at_most(Interval(0.12, 0.05, 0.2), m) == INCONCLUSIVE  # estimate over, CI wide
    assert verdict_within_points(Interval(0.0, 0.0, 0.0), 2) == PASS
    assert verdict_within_points(Interval(-1.0, -1.9, 0.0), 2) == PASS
    assert verdict_within_points(Interval(-6.0, -9.0, -3.0), 2) == FAIL
    assert verdict_within_points(Interval(-1.0, -4.0, 0.0), 2) == INCONCLUSIVE
    assert combine([PASS, PASS]) == PASS
    assert combine([PASS, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine([INCONCLUSIVE, FAIL, PASS]) == FAIL


def test_bootstrap_intervals_are_paired_and_seeded():
    ref = np.array([100.0, 120.0, 90.0, 110.0])
    same = relative_delta_interval(ref, ref)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    shifted = relative_delta_interval(ref * 1.01, ref)     # every window exactly 1% worse
    assert shifted.estimate == pytest.approx(1.0) and shifted.low == pytest.approx(1.0)
    assert shifted.high == pytest.approx(1.0)
    noisy = relative_delta_interval(ref + np.array([2.0, -1.0, 3.0, 0.0]), ref)
    assert noisy.low < noisy.estimate < noisy.high
    assert relative_delta_interval(ref + np.array([2.0, -1.0, 3.0, 0.0]), ref) == noisy
    one_miss = accuracy_delta_interval(np.array([1] * 99 + [0]), np.ones(100))
    assert one_miss.estimate == pytest.approx(-1.0)
    assert verdict_within_points(one_miss, 2) == INCONCLUSIVE   # 100 cases cannot settle 1 miss
    # Identical answers: the bootstrap collapses to 0, the exact bound does not (0 of n lost
    # allows 1 - 0.025^(1/n)); 100 cases cannot show "within 2 points", 200 can.
    same100 = accuracy_delta_interval(np.ones(100), np.ones(100))
    assert same100.estimate == 0.0 and same100.low == pytest.approx(-100 * (1 - 0.025 ** 0.01), rel=1e-6)
    assert verdict_within_points(same100, 2) == INCONCLUSIVE
    assert verdict_within_points(accuracy_delta_interval(np.ones(200), np.ones(200)), 2) == PASS
    lost = accuracy_delta_interval(np.array([0] * 20 + [1] * 80), np.ones(100))
    assert verdict_within_points(lost, 2) == FAIL


def test_sizes_presets():
    a = quality.resolve_sizes(quality.build_parser().parse_args(["--quick", "--probes", "9"]))
    assert a.probes == 9 and a.retrieval_cases == options.QUICK["retrieval_cases"]
    assert a.lengths == [512]
    full = quality.resolve_sizes(quality.build_parser().parse_args([]))
    assert full.nll_tokens >= 20000 and full.retrieval_cases >= 100 and full.probes >= 50
    assert full.lengths == [512, 1024, 2048, 4096]


def test_int4_without_rotation_stores_unrotated_keys_and_attends_exactly():
    from capacity.formats import KVFormat
    from engine.kv.store import Slots
    from engine.model.loader import LayerGeometry
    from engine.attention.packed import direct_attention
    from engine.kv.packed_store import PackedLayerStore
    from quality.runs import _UnrotatedAttention, _UnrotatedStore
    from engine.kv.quant import dequantize, quantize

    g = LayerGeometry(0, "full", 2, 64, 64)
    fmt = KVFormat("int4", 64)
    norot = _UnrotatedStore(g, fmt, 2, 16)
    rot = PackedLayerStore(g, fmt, 2, 16)
    k = mx.random.normal((20, 2, 64), key=mx.random.key(1))
    k = k + 20.0 * (mx.arange(64) == 3)              # an outlier channel, as real keys have
    v = mx.random.normal((20, 2, 64), key=mx.random.key(2))
    slots = Slots.from_flat(np.arange(20), 16)
    norot.write(slots, k, v)
    rot.write(slots, k, v)
    pages = mx.array([[0, 1]])
    assert mx.array_equal(norot.gather_packed(pages).k.codes[0, :, :20].swapaxes(0, 1),
                          quantize(k, 4).codes)
    def rms_err(store):
        back = store.gather(pages)[0][0, :, :20].swapaxes(0, 1)
        return mx.sqrt(mx.mean(mx.square(back - k))).item()

    err_norot, err_rot = rms_err(norot), rms_err(rot)
    assert err_rot < err_norot      # what the rotation buys on an outlier channel

    hist = norot.gather_packed(pages)
    hist = type(hist)(*(type(p)(*(a[..., :20, :] for a in p)) for p in hist))
    q = mx.random.normal((1, 6, 3, 64), key=mx.random.key(3))
    kn = mx.random.normal((1, 2, 3, 64), key=mx.random.key(4))
    vn = mx.random.normal((1, 2, 3, 64), key=mx.random.key(5))
    got = _UnrotatedAttention(fmt)(q, hist, kn, vn, scale=0.125)
    kd = mx.concatenate([dequantize(hist.k, 4), kn], axis=2)
    vd = mx.concatenate([dequantize(hist.v, 4), vn], axis=2)
    mask = mx.arange(23)[None] <= mx.arange(20, 23)[:, None]
    want = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125, mask=mask)
    assert mx.abs(got - want).max().item() < 1e-4
    # the rotated path over the same unrotated codes would be wrong: the adapter is load-bearing
    wrong = direct_attention(q, hist, kn, vn, fmt=fmt, scale=0.125)
    assert mx.abs(wrong - want).max().item() > 1e-2


def test_native_control_is_an_independent_run(monkeypatch):
    """The control must come from its own store: a harness that compared the reference with
    itself would report 0 even if runs were nondeterministic or stores leaked."""
    from quality import runs as quality_runs
    from engine.model.loader import load_model

    built = []
    real = quality_runs.make_runner
    monkeypatch.setattr(quality_runs, "make_runner",
                        lambda *a, **k: built.append(a[1]) or real(*a, **k))
    loaded = load_model(str(ROOT / "models" / "orchard-tiny"), dtype="float32")
    win = np.arange(100, 148)
    out = quality_runs.teacher_forced(loaded, [win], ["native"], chunk=16, batch=1,
                                      log=lambda m: None)
    assert built == ["native", "native"]
    assert out["native"].kl[0] == 0.0 and out["native"].tokens[0] == 48 - 1 - 16
