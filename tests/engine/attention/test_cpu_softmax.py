"""CPU attention with NumPy's softmax (engine/attention/cpu_softmax.py) and SwiGLU in NumPy
(engine/model/cpu_swiglu.py) give MLX's results, and the runner takes them on the CPU."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import cpu_softmax

from tests.engine.attention.runner_pairs import (ARCHS, assert_same_logits, chunked_prefill,
                                               record_calls, runner_pair)


def _qkv(b, hq, hkv, n, s, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((b, hq, n, 16)), mx.random.normal((b, hkv, s, 16)),
            mx.random.normal((b, hkv, s, 16)))


@pytest.mark.parametrize("n,s", [(7, 7), (40, 100), (300, 300), (130, 517)])
def test_causal_matches_mlx(n, s):
    # 300 and 130 query rows span several causal blocks (CAUSAL_BLOCK = 128).
    q, k, v = _qkv(1, 6, 2, n, s)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    got = cpu_softmax.prefill_attention(q, k, v, 0.25, "causal")
    assert got.shape == ref.shape
    assert mx.abs(got - ref).max().item() <= 1e-5


@pytest.mark.parametrize("scores", [1 << 23, 500])   # one block; blocks of a few rows
def test_array_mask_and_no_mask_match_mlx(monkeypatch, scores):
    monkeypatch.setattr(cpu_softmax, "SCORE_ELEMENTS", scores)
    q, k, v = _qkv(3, 4, 2, 9, 20, seed=1)
    rng = np.random.default_rng(0)
    keep = rng.random((3, 1, 9, 20)) < 0.6
    keep[..., 0] = True                       # no fully masked query row (as the runner's)
    mask = mx.array(keep)
    for m in (mask, None):
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=m)
        got = cpu_softmax.prefill_attention(q, k, v, 0.5, m)
        assert mx.abs(got - ref).max().item() <= 1e-5


def test_softmax_in_place_writes_the_array_it_returns():
    x = mx.random.normal((5, 33)) * 4
    ref = mx.softmax(x, axis=-1, precise=True)
    y = x + 0                                 # a fresh result this test alone holds
    assert cpu_softmax.softmax_in_place(y) is y
    assert mx.abs(y - ref).max().item() <= 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_runner_prefill_matches_mlx_attention(tiny_model_dirs, arch, monkeypatch):
    # With the prefill kernel off (it takes these calls by default: test_cpu_prefill.py).
    _, prompts, new, old = runner_pair(tiny_model_dirs[arch], 2, (45, 12, 30),
                                       both={"cpu_prefill": False}, cpu_softmax=False)
    assert new.cpu_softmax and not old.cpu_softmax   # the CPU suite, float32 pages
    calls = record_calls(monkeypatch, cpu_softmax, "prefill_attention", lambda q: q.shape[2])
    got = chunked_prefill(new, prompts)
    # Every multi-token call of a paged layer without sinks took it; gpt_oss's sinks never.
    assert (not calls) if arch == "gpt_oss" else calls and min(calls) > 1
    assert_same_logits(got, chunked_prefill(old, prompts))


def test_numpy_swiglu_matches_mlx():
    from mlx_lm.models.activations import swiglu

    from engine.model.cpu_swiglu import numpy_silu_mul
    gate = mx.concatenate([mx.random.normal((4, 30)) * 8, mx.array([[-200.0, -90, 0, 90]])],
                          axis=None).reshape(-1, 31)
    x = mx.random.normal(gate.shape)
    ref = swiglu(gate, x)
    assert mx.allclose(numpy_silu_mul(gate, x), ref, rtol=1e-5, atol=1e-6)
    # Strided halves of one array, as the fused gate/up projection hands them over.
    fused = mx.random.normal((3, 5, 16))
    g, u = mx.split(fused, [8], axis=-1)
    assert mx.allclose(numpy_silu_mul(g, u), swiglu(g, u), rtol=1e-5, atol=1e-6)


def test_runner_swiglu_in_numpy_only_inside_its_steps(tiny_llama, monkeypatch):
    from engine.model import cpu_swiglu
    calls = []
    real = cpu_swiglu.numpy_silu_mul
    monkeypatch.setattr(cpu_swiglu, "numpy_silu_mul",
                        lambda g, x: calls.append(g.shape) or real(g, x))
    lm, prompts, new, old = runner_pair(tiny_llama, 3, (33, 8), cpu_swiglu=False)
    assert new.cpu_swiglu and not old.cpu_swiglu
    ref = chunked_prefill(old, prompts)
    assert not calls   # hook installed by `new`, but `old`'s steps keep mlx-lm's function
    got = chunked_prefill(new, prompts)
    assert len(calls) == len(got) * lm.geometry.num_layers   # every layer of every forward
    for a, b in zip(got, ref):
        assert mx.abs(a - b).max().item() <= 1e-4
    calls.clear()
    lm.model(mx.array([prompts[0]]))   # mlx-lm's own call, outside a runner step
    assert not calls


def test_numpy_swiglu_split_over_two_threads_is_exact(monkeypatch):
    """From SPLIT_MIN_ELEMENTS a call runs half its rows on the parked worker: bit-identical to
    one thread."""
    from engine.model import cpu_swiglu
    gate, x = mx.random.normal((37, 3, 40)) * 6, mx.random.normal((37, 3, 40))
    whole = np.array(cpu_swiglu.numpy_silu_mul(gate, x))
    monkeypatch.setattr(cpu_swiglu, "SPLIT_MIN_ELEMENTS", 16)
    ran = []
    real = cpu_swiglu.parked_worker()

    class Recording:
        def submit(self, fn, *args):
            ran.append(args[0].shape[0])
            return real.submit(fn, *args)

    monkeypatch.setattr(cpu_swiglu, "parked_worker", lambda: Recording())
    assert np.array_equal(np.array(cpu_swiglu.numpy_silu_mul(gate, x)), whole)
    assert ran == [37 - 18]
