"""Decode attention through the Numba kernel over float32 pages (engine/attention/cpu_decode.py)
gives MLX's page-wise result, and the runner takes it for CPU decode rows."""
from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import cpu_decode
from engine.attention.paged import StepBatch, paged_decode_attention
from engine.sched.seq import Chunk

from tests.engine.attention.runner_pairs import (ARCHS, assert_same_logits, record_calls,
                                               runner_pair)


def _decode_case(kv_heads, group, contexts, page_tokens=16, seed=0):
    """Pages holding rows of the given contexts, each on shuffled (non-adjacent) pages, and one
    decode query per row; returns the step and its arrays."""
    rng = np.random.default_rng(seed)
    need = [-(-c // page_tokens) for c in contexts]
    ids = rng.permutation(sum(need) + 5)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n].tolist())
        at += n
    k = mx.array(rng.standard_normal((kv_heads, len(ids), page_tokens, 32)).astype(np.float32))
    v = mx.array(rng.standard_normal((kv_heads, len(ids), page_tokens, 32)).astype(np.float32))
    q = mx.array(rng.standard_normal((len(contexts), kv_heads * group, 1, 32)).astype(np.float32))
    rows = [Chunk(i, [1], c - 1, t) for i, (c, t) in enumerate(zip(contexts, tables))]
    return StepBatch(rows, page_tokens), q, k, v


@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1), (1, 8)])
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_matches_mlx_page_attention(kv_heads, group, window):
    contexts = [1, 15, 16, 17, 70, 203]
    step, q, k, v = _decode_case(kv_heads, group, contexts)
    view = step.view(window)
    ref = paged_decode_attention(q, k, v, step, view, 0.3, None)
    lo, hi = cpu_decode.row_bounds(view.base, step.starts, step.lengths, window)
    got = cpu_decode.decode_attention(q, k, v, view.pages_np, lo, hi, 0.3)
    assert got.shape == ref.shape and got.dtype == mx.float32
    assert mx.abs(got - ref).max().item() <= 1e-5


def test_row_bounds_follow_the_window():
    # Row at position 99 (100 keys) whose view starts at page 3 of 16-token pages (key 48):
    # a 20-key window sees keys 80..99, i.e. 32..51 of its view.
    lo, hi = cpu_decode.row_bounds(np.array([48]), np.array([99]), np.array([1]), 20)
    assert (lo.tolist(), hi.tolist()) == ([32], [52])
    lo, hi = cpu_decode.row_bounds(np.array([0]), np.array([5]), np.array([1]), None)
    assert (lo.tolist(), hi.tolist()) == ([0], [6])


def test_a_split_step_equals_the_unsplit_one_and_the_worker_runs_half(monkeypatch):
    """From SPLIT_MIN_ROWS rows a call runs about half its keys on the parked worker thread;
    every row is computed as unsplit (bit-identical), whatever the split point."""
    step, q, k, v = _decode_case(3, 3, [5, 300, 17, 40, 90, 130, 16, 64], seed=5)
    view = step.view(None)
    lo, hi = cpu_decode.row_bounds(view.base, step.starts, step.lengths, None)
    monkeypatch.setattr(cpu_decode, "SPLIT", False)
    whole = np.asarray(cpu_decode.decode_attention(q, k, v, view.pages_np, lo, hi, 0.25))
    monkeypatch.setattr(cpu_decode, "SPLIT", True)
    ran = []
    real = cpu_decode.cpu_worker.parked_worker()

    class Recording:
        def submit(self, fn, first, end):   # the worker's rows first..end-1
            ran.append((threading.get_ident(), end - first))
            return real.submit(lambda *a: (ran.append(threading.get_ident()), fn(*a)), first,
                               end)

    monkeypatch.setattr(cpu_decode.cpu_worker, "parked_worker", lambda: Recording())
    split = np.asarray(cpu_decode.decode_attention(q, k, v, view.pages_np, lo, hi, 0.25))
    assert np.array_equal(split, whole)
    (caller, worker_rows), worker = ran
    assert worker != caller and 0 < worker_rows < 8
    # Three rows: below SPLIT_MIN_ROWS, nothing goes to the worker.
    few = np.asarray(cpu_decode.decode_attention(q[:3], k, v, view.pages_np[:3], lo[:3], hi[:3],
                                                 0.25))
    assert np.array_equal(few, whole[:3]) and len(ran) == 2


def test_engines_on_several_threads_may_call_it_at_once():
    # The kernel holds no pool or state: one engine thread per replica, several per process,
    # all splitting onto the one parked worker (6 rows).
    step, q, k, v = _decode_case(3, 3, [40, 90, 130, 7, 33, 64], seed=3)
    view = step.view(None)
    lo, hi = cpu_decode.row_bounds(view.base, step.starts, step.lengths, None)
    ref = np.asarray(cpu_decode.decode_attention(q, k, v, view.pages_np, lo, hi, 0.2))
    results, errors = [], []

    def call():
        try:
            for _ in range(20):
                results.append(np.asarray(
                    cpu_decode.decode_attention(q, k, v, view.pages_np, lo, hi, 0.2)))
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 80
    assert all(np.array_equal(r, ref) for r in results)


def _decode_steps(runner, prompts, steps=3):
    """Prefill each prompt in one call, then `steps` decode steps of every row together; the
    decode steps' logits."""
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    for i, t in enumerate(prompts):
        runner.forward([Chunk(i, t, 0, tables[i])])
    out = []
    for s in range(steps):
        out.append(runner.forward([Chunk(i, [5 + s], len(t) + s, tables[i])
                                   for i, t in enumerate(prompts)]))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_runner_decode_takes_the_kernel(tiny_model_dirs, arch, monkeypatch):
    _, prompts, new, old = runner_pair(tiny_model_dirs[arch], 4, (45, 12, 30), cpu_decode=False)
    assert new.cpu_decode and not old.cpu_decode   # the CPU suite, float32 pages
    calls = record_calls(monkeypatch, cpu_decode, "decode_attention", lambda q: q.shape)
    got = _decode_steps(new, prompts)
    # Decode rows of paged layers without sinks took it (gemma3's sliding layers too);
    # gpt_oss's sinks never; prompts (many tokens per row) never.
    if arch == "gpt_oss":
        assert not calls
    else:
        assert calls and all(s[0] == 3 and s[2] == 1 for s in calls)
    assert_same_logits(got, _decode_steps(old, prompts))
