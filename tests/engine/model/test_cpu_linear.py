"""Projections of few rows through the Numba kernel (engine/model/cpu_linear.py): the product
MLX computes, taken only inside the runner's CPU steps, for float32 calls of at most MAX_ROWS."""
from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.model import cpu_linear
from engine.sched.seq import Chunk

from tests.engine.attention.runner_pairs import (ARCHS, assert_same_logits, record_calls,
                                               runner_pair)


@pytest.mark.parametrize("rows,out,inner", [(1, 7, 5), (2, 3, 64), (3, 9, 64), (16, 3072, 576),
                                            (17, 577, 96), (32, 13, 1536)])
def test_kernel_equals_the_matmul(rows, out, inner):
    # Odd rows (a last single row), columns not a multiple of 4, too few to split, and the
    # decode shapes of SmolLM2's fused projections.
    rng = np.random.default_rng(rows * out)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    w = rng.standard_normal((out, inner)).astype(np.float32)
    got = cpu_linear.skinny_matmul(x, w)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert got.shape == (rows, out) and got.dtype == np.float32
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.sqrt(inner))


def test_each_row_is_the_same_whatever_rows_come_with_it():
    # Bit for bit: merged steps rely on it (tests/engine/runner/test_merged_packed.py).
    rng = np.random.default_rng(3)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((7, 96), (50, 96)))
    whole = cpu_linear.skinny_matmul(x, w)
    for i in range(7):
        assert np.array_equal(cpu_linear.skinny_matmul(x[i:i + 1], w)[0], whole[i])
    assert np.array_equal(cpu_linear.skinny_matmul(x[2:6], w), whole[2:6])


def test_the_worker_takes_the_second_half_of_the_columns(monkeypatch):
    rng = np.random.default_rng(1)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((5, 40), (30, 40)))
    ran = []
    real = cpu_linear.parked_worker()

    class Recording:
        def submit(self, fn, *args):
            ran.append((threading.get_ident(), args[-2:]))
            return real.submit(fn, *args)

    monkeypatch.setattr(cpu_linear, "parked_worker", lambda: Recording())
    got = cpu_linear.skinny_matmul(x, w)
    assert ran == [(threading.get_ident(), (12, 30))]   # columns 12..29 there, 0..11 here
    assert np.allclose(got, x @ w.T, atol=1e-4)


def test_hooked_linears_take_the_kernel_only_inside_the_context(monkeypatch):
    model = nn.Sequential(nn.Linear(24, 10), nn.Linear(10, 6, bias=False))
    half = nn.Linear(6, 4)
    half.set_dtype(mx.bfloat16)
    model.layers.append(half)
    assert cpu_linear.install_linear_hook(model) == 2      # float32 ones only
    assert cpu_linear.install_linear_hook(model) == 0      # idempotent: none left to change
    assert type(model.layers[2]) is nn.Linear and type(model.layers[0]) is cpu_linear.SkinnyLinear
    calls = record_calls(monkeypatch, cpu_linear, "skinny_matmul", lambda x: x.shape[0])
    x = mx.random.normal((3, 2, 24))
    first, second = model.layers[0], model.layers[1]
    ref = second(first(x))
    assert not calls                                      # outside: nn.Linear's own call
    with cpu_linear.skinny_linears():
        got = second(first(x))                            # bias added, leading axes kept
        assert calls == [6, 6] and got.shape == (3, 2, 6)
        second(mx.random.normal((cpu_linear.MAX_ROWS + 1, 10)))   # too many rows: MLX
        with cpu_linear.skinny_linears(False):
            second(mx.random.normal((2, 10)))
    assert calls == [6, 6]
    assert mx.allclose(got, ref, atol=1e-5)


def test_a_tied_lm_head_takes_it_too(monkeypatch):
    from engine.model.linear import pretranspose
    emb = nn.Embedding(50, 12)
    model = nn.Sequential(emb)
    pretranspose(model)
    assert cpu_linear.install_linear_hook(model) == 1 and type(emb) is cpu_linear.SkinnyEmbedding
    calls = record_calls(monkeypatch, cpu_linear, "skinny_matmul", lambda x: x.shape[0])
    x = mx.random.normal((4, 12))
    ref = emb.as_linear(x)
    with cpu_linear.skinny_linears():
        got = emb.as_linear(x)
        assert mx.array_equal(emb(mx.array([3, 7])), emb.weight[mx.array([3, 7])])  # lookup
    assert calls == [4] and mx.allclose(got, ref, atol=1e-5)


def _steps(runner, prompts, calls, steps=3):
    """The prompts in one forward, then `steps` decode steps of every row; every forward's
    logits, and the kernel's row counts in the prompt forward and in the decode steps."""
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    out = [runner.forward([Chunk(i, t, 0, tables[i]) for i, t in enumerate(prompts)])]
    prompt_calls = list(calls)
    calls.clear()
    for s in range(steps):
        out.append(runner.forward([Chunk(i, [5 + s], len(t) + s, tables[i])
                                   for i, t in enumerate(prompts)]))
    return out, prompt_calls, list(calls)


@pytest.mark.parametrize("arch", ARCHS)
def test_runner_decode_projections_take_the_kernel(tiny_model_dirs, arch, monkeypatch):
    _, prompts, new, old = runner_pair(tiny_model_dirs[arch], 6, (45, 40, 30), cpu_linear=False)
    assert new.cpu_linear and not old.cpu_linear   # the CPU suite, float32 pages
    calls = record_calls(monkeypatch, cpu_linear, "skinny_matmul", lambda x: x.shape[0])
    got, prompt_calls, decode_calls = _steps(new, prompts, calls)
    # Every projection of the decode steps (3 rows) and their LM head took it; in the prompts'
    # forward only calls of at most MAX_ROWS tokens (a model without merged steps runs the
    # 30-token prompt alone; every call's LM head takes its rows' last positions).
    assert decode_calls and set(decode_calls) == {3}
    assert max(prompt_calls) <= cpu_linear.MAX_ROWS
    ref = _steps(old, prompts, [])[0]
    assert_same_logits(got, ref)
