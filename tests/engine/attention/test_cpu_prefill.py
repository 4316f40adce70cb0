"""Prefill attention through the Numba kernel over float32 pages (engine/attention/cpu_prefill.py)
gives MLX's attention over the gathered keys with the step's mask, and the runner takes it for
CPU multi-token rows."""
from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import cpu_prefill
from engine.attention.paged import StepBatch
from engine.sched.seq import Chunk

from tests.engine.attention.runner_pairs import (ARCHS, assert_same_logits, chunked_prefill,
                                               record_calls, runner_pair)


def _prefill_case(kv_heads, group, rows, dim=32, page_tokens=16, seed=0):
    """Pages for rows of (history, new tokens), each on shuffled (non-adjacent) pages, and the
    call's queries (padded to its longest row); returns the step and its arrays."""
    rng = np.random.default_rng(seed)
    need = [-(-(h + n) // page_tokens) for h, n in rows]
    ids = rng.permutation(sum(need) + 5)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n].tolist())
        at += n
    k = mx.array(rng.standard_normal((kv_heads, len(ids), page_tokens, dim)).astype(np.float32))
    v = mx.array(rng.standard_normal((kv_heads, len(ids), page_tokens, dim)).astype(np.float32))
    step = StepBatch([Chunk(i, [1] * n, h, t) for i, ((h, n), t) in enumerate(zip(rows, tables))],
                     page_tokens)
    q = mx.array(rng.standard_normal((len(rows), kv_heads * group, step.width, dim))
                 .astype(np.float32) * 2)
    return step, q, k, v


def _reference(step, view, q, k, v, scale):
    """MLX's SDPA over the rows' gathered pages with the step's page mask."""
    b, p = view.pages_np.shape
    kg = k[:, view.pages].reshape(k.shape[0], b, p * step.page_tokens, -1).swapaxes(0, 1)
    vg = v[:, view.pages].reshape(v.shape[0], b, p * step.page_tokens, -1).swapaxes(0, 1)
    return mx.fast.scaled_dot_product_attention(q, kg, vg, scale=scale,
                                                mask=step.page_mask(view))


def _kernel(step, view, q, k, v, scale):
    return cpu_prefill.prefill_attention(q, k, v, view.pages_np, step.starts, view.base,
                                         step.lengths, view.window, scale)


def _real(step, x):
    """Each row's real query positions (padding dropped): [sum(lengths), heads, dim]."""
    a = np.asarray(x)
    return np.concatenate([a[i, :, :n].swapaxes(0, 1) for i, n in enumerate(step.lengths)])


ROWS = {
    "one prompt": [(0, 70)],
    "chunk after history": [(45, 30)],
    "rows of different lengths": [(0, 19), (33, 40), (16, 7), (100, 2)],
}


@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1), (1, 8)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("rows", list(ROWS))
def test_kernel_matches_mlx_attention(kv_heads, group, window, rows):
    step, q, k, v = _prefill_case(kv_heads, group, ROWS[rows])
    view = step.view(window)
    got = _kernel(step, view, q, k, v, 0.3)
    assert got.shape == q.shape and got.dtype == mx.float32
    ref = _reference(step, view, q, k, v, 0.3)
    assert np.abs(_real(step, got) - _real(step, ref)).max() <= 1e-5
    # Padded query positions are never computed: zeros, not another query's output.
    a = np.asarray(got)
    for i, n in enumerate(step.lengths):
        assert not a[i, :, n:].any()


@pytest.mark.parametrize("dim,page_tokens", [(64, 64), (128, 4), (80, 16)])
def test_head_sizes_and_pages(dim, page_tokens):
    # 64 and 128 channels (eight per pass), 80 (a remainder pass); pages of 4 to 64 tokens.
    step, q, k, v = _prefill_case(2, 3, [(5, 60), (70, 9)], dim=dim, page_tokens=page_tokens,
                                  seed=2)
    view = step.view(None)
    ref = _reference(step, view, q, k, v, dim ** -0.5)
    got = _kernel(step, view, q, k, v, dim ** -0.5)
    assert np.abs(_real(step, got) - _real(step, ref)).max() <= 1e-5


def test_extreme_scores_stay_finite_and_exact():
    # Scores hundreds apart: exp underflows to zero for all but the top keys, as MLX's does.
    step, q, k, v = _prefill_case(1, 2, [(30, 20)], seed=4)
    q = q * 40
    view = step.view(None)
    got, ref = _kernel(step, view, q, k, v, 1.0), _reference(step, view, q, k, v, 1.0)
    assert np.isfinite(np.asarray(got)).all()
    assert np.abs(_real(step, got) - _real(step, ref)).max() <= 1e-5


def test_a_split_call_equals_the_unsplit_one_and_the_worker_runs_part(monkeypatch):
    """From SPLIT_MIN_PAIRS key reads a call runs its later queries on the parked worker
    thread; every query is computed as unsplit (bit-identical), whatever the split point."""
    step, q, k, v = _prefill_case(3, 3, [(40, 150), (0, 120)], seed=5)
    view = step.view(None)
    monkeypatch.setattr(cpu_prefill, "SPLIT", False)
    whole = np.asarray(_kernel(step, view, q, k, v, 0.25))
    monkeypatch.setattr(cpu_prefill, "SPLIT", True)
    ran = []
    real = cpu_prefill.cpu_worker.parked_worker()

    class Recording:
        def submit(self, fn, *args):
            ran.append((threading.get_ident(), args[-2:]))
            return real.submit(lambda *a: (ran.append(threading.get_ident()), fn(*a)), *args)

    monkeypatch.setattr(cpu_prefill.cpu_worker, "parked_worker", lambda: Recording())
    split = np.asarray(_kernel(step, view, q, k, v, 0.25))
    assert np.array_equal(split, whole)
    (caller, (m, width)), worker = ran
    assert worker != caller and 0 < m < width == 150
    # A small call stays on the calling thread.
    small, sq, sk, sv = _prefill_case(3, 3, [(0, 12)], seed=6)
    _kernel(small, small.view(None), sq, sk, sv, 0.25)
    assert len(ran) == 2


def test_split_point_halves_the_key_reads():
    # One 200-token prompt: query i reads i + 1 keys, so half the reads end near 200 / sqrt(2).
    m = cpu_prefill.split_point(np.array([0]), np.array([0]), np.array([200]), 200, None)
    assert 138 <= m <= 144
    # A window caps every query's reads: the split falls near the middle.
    m = cpu_prefill.split_point(np.array([500]), np.array([0]), np.array([400]), 400, 100)
    assert 198 <= m <= 202
    # Too few reads to pay for the hand-off: no split.
    assert cpu_prefill.split_point(np.array([0]), np.array([0]), np.array([20]), 20, None) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_runner_prefill_takes_the_kernel(tiny_model_dirs, arch, monkeypatch):
    _, prompts, new, old = runner_pair(tiny_model_dirs[arch], 2, (45, 12, 30), cpu_prefill=False)
    assert new.cpu_prefill and not old.cpu_prefill   # the CPU suite, float32 pages
    calls = record_calls(monkeypatch, cpu_prefill, "prefill_attention", lambda q: q.shape[2])
    got = chunked_prefill(new, prompts)
    # Every multi-token call of a paged layer without sinks took it (gemma3's sliding layers
    # too); gpt_oss's sinks never; decode rows never.
    assert (not calls) if arch == "gpt_oss" else calls and min(calls) > 1
    assert_same_logits(got, chunked_prefill(old, prompts))
