"""Prefill width buckets (EngineConfig.prefill_width_bucket) change shapes, never results.

With the knob set, a multi-token call is padded to a multiple of the bucket and its keys span
whole pages, so calls of any prompt length share a few (queries, keys) shapes. What these pin:
the shapes really are bucketed (one-row calls too, which then need an array mask, not mlx-lm's
"causal" string); decode calls are untouched; logits of every real position and the K/V written
equal the exact-shape runner's, for one row and several uneven rows, with history that starts
mid-page, on full, sliding-window and sink attention, a packed format and a hybrid model with
recurrent state; padded positions write nothing (slots past each row's end keep the junk placed
there first, and that junk, read as masked keys, does not move a logit); an engine with the knob
generates what one without does.
"""
from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine
from engine.attention.layers import packed_layer_factory
from engine.attention.paged import StepBatch
from engine.config import EngineConfig
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.packed import PackedModelRunner
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk
from tests.engine.runner.test_runner_recurrent import lfm2  # noqa: F401  (fixture: LFM2, conv state)
from tests.engine_helpers import PAGE_BYTES_LLAMA, collect, req, run, tokens, wait_idle

PAGE = 8
BUCKET = 32
PAGES = 40
# Scattered page tables: rows 0-2 use these pages, the rest of the pool stays unused.
TABLES = [[31, 2, 17, 8, 25, 11, 0], [5, 22, 14, 39, 1, 28], [12, 33, 3, 26]]


def _chunk(seq, ids, start):
    return Chunk(seq, ids, start, TABLES[seq])


def _steps(prompts):
    """Calls of a chunked prefill then decode: one row from 0, one row resuming mid-page (13 is
    not a multiple of 8), uneven rows (5, 20 and 3 tokens) of which one has history, decode."""
    p0, p1, p2 = prompts
    return [
        [_chunk(0, p0[:13], 0)],
        [_chunk(0, p0[13:30], 13)],
        [_chunk(0, p0[30:35], 30), _chunk(1, p1[:20], 0), _chunk(2, p2[:3], 0)],
        [_chunk(1, p1[20:27], 20), _chunk(2, p2[3:25], 3)],
        [_chunk(0, [p0[35]], 35), _chunk(1, [p1[27]], 27), _chunk(2, [p2[25]], 25)],
    ]


def _junk_pages(store, seed=0):
    """Fill every native page with finite junk: masked keys then hold values that would move
    the logits if any were attended (zeros would hide a bad mask behind small scores)."""
    rng = np.random.default_rng(seed)
    for layer in store.layers.values():
        layer.adopt([mx.array(rng.normal(0, 4, a.shape).astype(np.float32)).astype(a.dtype)
                     for a in layer.arrays()])


def _written_slots():
    """(page, offset) slots the steps of `_steps` write, per page."""
    ends = {0: 36, 1: 28, 2: 26}
    used: dict[int, int] = {}
    for seq, n in ends.items():
        for pos in range(n):
            page = TABLES[seq][pos // PAGE]
            used[page] = max(used.get(page, 0), pos % PAGE + 1)
    return used


def _run_steps(runner, prompts, all_positions):
    out = []
    for chunks in _steps(prompts):
        if all_positions:
            out.append([np.array(x) for x in runner.forward_all(chunks)])
        else:
            out.append([np.array(runner.forward(chunks))])
    mx.eval(*runner.kvstore.arrays())
    return out


def _native_runner(lm, bucket):
    store = KVStore(lm.geometry, PAGES, PAGE, lm.dtype)
    _junk_pages(store)
    # A large padding allowance: the uneven rows of a step share one call.
    return ModelRunner(lm, store, merge_pad_tokens=1000, prefill_width_bucket=bucket)


def test_step_shapes_are_bucketed():
    def step(lengths, starts=None, bucket=BUCKET, page=PAGE):
        starts = starts or [0] * len(lengths)
        rows = [Chunk(i, [1] * n, s, list(range(i * 30, i * 30 + 30)))
                for i, (n, s) in enumerate(zip(lengths, starts))]
        return StepBatch(rows, page, bucket)

    # Widths: up to the next multiple of the bucket, never below it; decode stays width 1.
    assert [step([n]).width for n in (2, 13, 32, 33, 64)] == [32, 32, 32, 64, 64]
    assert step([5, 20, 3]).width == 32
    assert step([1, 1]).width == 1 and step([1]).view(None).key_slice == (0, 1)
    assert step([13], bucket=None).width == 13
    # One row: whole pages of keys and an array mask over them (L > S here: 32 queries, 16 keys).
    s = step([13], [3])
    v = s.view(None)
    assert v.key_slice is None and v.pages_np.shape == (1, 2)
    mask = s.sdpa_mask(v)
    assert isinstance(mask, mx.array) and mask.shape == (1, 1, 32, 16)
    # Padded queries see what the row's last real token sees: keys 0..15 (start 3 + 13 tokens).
    assert np.array(mask[0, 0, 12:]).all() and np.array(mask[0, 0, 0, :4]).all()
    assert not np.array(mask[0, 0, 0, 4:]).any()
    # Only real tokens are written.
    assert s.valid is not None and s.valid.size == 13 and s.slots.page_np.size == 13
    # Prompts of 2..224 tokens with pages as long as the bucket (the served default: 64 and
    # 64): 7 (queries, keys) shapes instead of 223.
    shapes = {(b.width, b.view(None).pages_np.shape[1] * 32)
              for b in (step([n], page=32) for n in range(2, 225))}
    assert shapes == {(w, w) for w in range(32, 225, 32)}


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("all_positions", [False, True])
def test_bucketed_runner_matches_exact_shapes(tiny_model_dirs, arch, all_positions):
    lm = load_model(tiny_model_dirs[arch])
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, lm.geometry.vocab_size, 40).tolist() for _ in range(3)]
    exact, bucketed = _native_runner(lm, None), _native_runner(lm, BUCKET)
    before = [np.array(a) for a in bucketed.kvstore.arrays()]
    a = _run_steps(exact, prompts, all_positions)
    b = _run_steps(bucketed, prompts, all_positions)
    for n, (x, y) in enumerate(zip(a, b)):
        for u, w in zip(x, y):
            assert u.shape == w.shape, n
            assert np.abs(u - w).max() <= 1e-4, (n, np.abs(u - w).max())
    # Same K/V written, within float noise (attention over whole pages sums in another order, and
    # the BLAS may block a padded projection's rows differently: not bit for bit even in the
    # first layer with the OpenBLAS a fresh bootstrap installs).
    # Every slot no step wrote still holds its junk, bit for bit: padded positions write
    # nothing, not even past a row's end in its last page.
    used = _written_slots()
    arrays = list(zip(before, exact.kvstore.arrays(), bucketed.kvstore.arrays()))
    # Written slots are compared across the two stores; unwritten ones each against its own
    # store's junk (two pools' junk need not match: the allocator may hand either old memory).
    for i, (old, x, y) in enumerate(arrays):
        x, y = np.array(x), np.array(y)
        for page in range(PAGES):
            n = used.get(page, 0)
            u, w = x[:, page, :n], y[:, page, :n]
            assert np.abs(u - w).max(initial=0) <= 1e-4, (i, page)
            assert np.array_equal(y[:, page, n:], old[:, page, n:]), page


def test_bucketed_packed_runner_matches_exact_shapes(tiny_llama):
    lm = load_model(tiny_llama)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, lm.geometry.vocab_size, 40).tolist() for _ in range(3)]

    def runner(bucket):
        store = KVStore(lm.geometry, PAGES, PAGE, lm.dtype,
                        layer_factory=packed_layer_factory("int8"))
        return PackedModelRunner(lm, store, merge_pad_tokens=1000, prefill_width_bucket=bucket)

    exact, bucketed = runner(None), runner(BUCKET)
    a, b = _run_steps(exact, prompts, True), _run_steps(bucketed, prompts, True)
    for x, y in zip(a, b):
        for u, w in zip(x, y):
            assert np.abs(u - w).max() <= 1e-2
    # Every layer's K/V, read back, within float noise but for some codes a quantization step
    # apart: a padded projection need not be bit for bit the exact one's (the BLAS may block its
    # rows differently), so a value on a rounding boundary may round the other way, and the
    # logits above move by that (measured 3.8e-3 with a fresh bootstrap's OpenBLAS).
    every = mx.array(np.arange(PAGES, dtype=np.int32)[None])
    for i in exact.kvstore.layers:
        for x, y in zip(exact.kvstore.layer(i).gather(every),
                        bucketed.kvstore.layer(i).gather(every)):
            d = mx.abs(x - y)
            assert d.max().item() <= 0.05   # measured: 9.9e-3, 3 % of values above 1e-4


def test_bucketed_recurrent_model_matches_exact_shapes(lfm2):
    """A hybrid model's conv state sees the padded width too (one-row calls are padded now): it
    must take each row's real length from `lengths`, as it does for uneven rows."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, lfm2.geometry.vocab_size, 40).tolist() for _ in range(3)]
    runners = [ModelRunner(lfm2, KVStore(lfm2.geometry, PAGES, PAGE, lfm2.dtype),
                           merge_pad_tokens=1000, prefill_width_bucket=b) for b in (None, BUCKET)]
    a, b = (_run_steps(r, prompts, True) for r in runners)
    for x, y in zip(a, b):
        for u, w in zip(x, y):
            assert np.abs(u - w).max() <= 1e-4


def test_knob_is_validated(tiny_llama):
    with pytest.raises(ValueError, match="prefill_width_bucket"):
        EngineConfig(model=tiny_llama, prefill_width_bucket=0)
    lm = load_model(tiny_llama)
    with pytest.raises(ValueError, match="prefill_width_bucket"):
        ModelRunner(lm, KVStore(lm.geometry, 4, PAGE, lm.dtype), prefill_width_bucket=0)


@pytest.mark.parametrize("kv_format", ["native", "int8"])
def test_engine_with_buckets_generates_what_the_plain_engine_does(tiny_llama, kv_format):
    def build(**cfg):
        # 24-token steps: the 41- and 30-token prompts prefill in chunks that start mid-page.
        return Engine(EngineConfig(model=tiny_llama, kv_budget_bytes=64 * PAGE_BYTES_LLAMA,
                                   page_tokens=16, max_step_tokens=24, kv_format=kv_format,
                                   **cfg))

    async def batch(eng):
        rs = [req("a", n_prompt=41, pseed=1, max_tokens=20, ignore_eos=True),
              req("b", n_prompt=5, pseed=2, max_tokens=9, ignore_eos=True),
              req("c", n_prompt=30, pseed=5, max_tokens=15, ignore_eos=True),
              req("d", n_prompt=9, pseed=7, max_tokens=16)]
        return [tokens(d) for d in await asyncio.gather(*(collect(eng, r) for r in rs))]

    engines = [build(), build(prefill_width_bucket=BUCKET)]
    try:
        assert engines[1]._parts.runner.prefill_width_bucket == BUCKET   # passed through
        assert engines[0]._parts.runner.prefill_width_bucket is None
        plain, bucketed = (run(batch(e)) for e in engines)
        assert plain == bucketed and all(plain)
        for e in engines:
            assert wait_idle(e).kv_pages_used == 0
    finally:
        for e in engines:
            e.shutdown()
