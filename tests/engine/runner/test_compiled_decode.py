"""Compiled decode steps (engine/runner/compiled_decode.py) compute what uncompiled steps do.

Production compiles decode steps only where the CUDA decode kernel runs; these tests force them
on the CPU (`KernelChoices(compiled_decode=True)`), where attention inside the trace takes the
gather-and-mask path. What they pin: the same logits and K/V pages as the uncompiled runner,
step by step, through page-bucket growth, uneven rows and non-contiguous page tables; one trace
per shape, not per step (a host value leaking into a trace would give wrong logits on replay);
the runner refuses the compiled path where a step would not fit it; an engine with compiled
steps generates exactly what the plain engine generates, pipelined and synchronous.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.choices import KernelChoices
from engine.config import EngineConfig
from engine.kv.store import KVStore
from engine import Engine
from engine.model.loader import load_model
from engine.runner import compiled_decode
from engine.runner.compiled_decode import CompiledDecode, bucket_pages, bucket_rows
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk
from tests.engine_helpers import PAGE_BYTES_LLAMA, collect, req, run, tokens, wait_idle

COMPILED = KernelChoices(compiled_decode=True)
PLAIN = KernelChoices(compiled_decode=False)


def _runner(lm, kernels, pages=40, page_tokens=8):
    return ModelRunner(lm, KVStore(lm.geometry, pages, page_tokens, lm.dtype), kernels=kernels)


def _decode(runner, prompts, tables, steps, lazy):
    """Prefill, then greedy one-token steps; returns every step's logits (numpy)."""
    logits = runner.forward([Chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    toks = mx.argmax(logits, axis=-1).astype(mx.int32)
    lens = [len(p) for p in prompts]
    out = []
    for _ in range(steps):
        if lazy:   # as pipelined decode feeds them: the previous step's sampled array
            chunks = [Chunk(i, toks[i:i + 1], lens[i], tables[i]) for i in range(len(lens))]
            logits = runner.forward(chunks, decode_tokens=toks)
        else:
            ids = np.array(toks).tolist()
            logits = runner.forward([Chunk(i, [ids[i]], lens[i], tables[i])
                                     for i in range(len(lens))])
        toks = mx.argmax(logits, axis=-1).astype(mx.int32)
        out.append(np.array(logits))
        lens = [n + 1 for n in lens]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_steps_match_uncompiled(tiny_model_dirs, arch):
    lm = load_model(tiny_model_dirs[arch])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in (5, 30, 17)]
    # Scattered, interleaved page ids: the table, not the id order, must decide what is read.
    tables = [[31, 2, 17, 8, 25, 11, 0, 36], [5, 22, 14, 39, 1, 28, 9, 19],
              [12, 33, 3, 26, 7, 20, 38, 15]]
    fast, slow = _runner(lm, COMPILED), _runner(lm, PLAIN)
    assert fast.compiled is not None and slow.compiled is None
    # 24 steps take the longest row from 30 to 54 keys: 4 -> 7 pages of 8, across a bucket.
    for lazy in (True, False):
        a = _decode(fast, prompts, tables, 24, lazy)
        b = _decode(slow, prompts, tables, 24, lazy)
        for step, (x, y) in enumerate(zip(a, b)):
            assert np.abs(x - y).max() <= 1e-4, (lazy, step)
    # The written pages are the same too (every layer, K and V).
    for x, y in zip(fast.kvstore.arrays(), slow.kvstore.arrays()):
        assert mx.abs(x - y).max().item() <= 1e-4
    # One trace per shape: 3 rows x page buckets 4 and 8, for each token source (a lazy
    # argmax array and a host list both arrive as int32 [3]).
    assert fast.compiled.traces == 2


def test_one_row_is_traced_once_per_bucket(tiny_llama):
    lm = load_model(tiny_llama)
    runner = _runner(lm, COMPILED, page_tokens=4)
    table = [9, 3, 30, 14, 1, 22, 6, 17, 25, 11, 38, 0, 5, 27]
    ref = _runner(lm, PLAIN, page_tokens=4)
    a = _decode(runner, [[7, 8, 9]], [table], 50, lazy=True)   # 4 -> 53 keys: 1 -> 14 pages
    b = _decode(ref, [[7, 8, 9]], [table], 50, lazy=True)
    assert max(np.abs(x - y).max() for x, y in zip(a, b)) <= 1e-4
    assert runner.compiled.traces == 3   # buckets of 4, 8 and 16 pages


def test_tables_growing_by_appends_are_followed_and_converted_once(tiny_llama):
    """Page lists that grow by appending (as PageTable's do) between compiled steps: logits and
    pages equal the uncompiled runner's every step, and each id is converted from its list once
    (RowPages), not once per step; a new list for the same sequence is converted afresh."""
    lm = load_model(tiny_llama)
    fast, slow = _runner(lm, COMPILED, page_tokens=4), _runner(lm, PLAIN, page_tokens=4)
    spare = [30, 2, 17, 8, 25, 11, 36, 5, 22, 14, 39, 1, 28, 9, 19, 33]
    prompts = [[7, 8, 9, 10, 11], [3, 4]]
    owned = {r: [[31, 12], [0]] for r in ("fast", "slow")}   # just enough for the prompts
    for r, runner in (("fast", fast), ("slow", slow)):
        runner.forward([Chunk(i, p, 0, owned[r][i]) for i, p in enumerate(prompts)])
    lens, free = [5, 2], {r: list(spare) for r in owned}
    for step in range(20):   # 5 -> 25 and 2 -> 22 keys: rows cross 5 page boundaries each
        got = []
        for r, runner in (("fast", fast), ("slow", slow)):
            for i, n in enumerate(lens):
                if n // 4 + 1 > len(owned[r][i]):
                    owned[r][i].append(free[r].pop(0))   # the same list object grows
            got.append(np.array(runner.forward(
                [Chunk(i, [5 + step], n, owned[r][i]) for i, n in enumerate(lens)])))
        assert np.abs(got[0] - got[1]).max() <= 1e-4, step
        lens = [n + 1 for n in lens]
    for x, y in zip(fast.kvstore.arrays(), slow.kvstore.arrays()):
        assert mx.abs(x - y).max().item() <= 1e-4
    pages = fast.compiled.row_pages
    assert pages.converted == sum(n // 4 + 1 for n in (24, 21))   # each needed id once
    fast.forward([Chunk(0, [1], lens[0], list(owned["fast"][0]))])   # a new list object
    assert pages.converted == sum(n // 4 + 1 for n in (24, 21)) + lens[0] // 4 + 1


def test_compiled_steps_refuse_page_ids_out_of_range_and_write_nothing(tiny_llama):
    """The compiled step checks the ids it converts (the runner leaves that to it): an id out
    of range, on a row's first step or appended later, is refused before anything runs."""
    lm = load_model(tiny_llama)
    runner = _runner(lm, COMPILED, pages=8, page_tokens=4)
    table = [3]
    runner.forward([Chunk(0, [1, 2, 3], 0, table)])
    before = [np.array(a) for a in runner.kvstore.arrays()]
    with pytest.raises(ValueError, match="sequence 1: page id out of range"):
        runner.forward([Chunk(0, [4], 3, table), Chunk(1, [4], 0, [8])])
    runner.forward([Chunk(0, [4], 3, table)])   # fills page 3
    table.append(-1)   # the list grows by a bad id
    written = [np.array(a) for a in runner.kvstore.arrays()]
    with pytest.raises(ValueError, match="sequence 0: page id out of range"):
        runner.forward([Chunk(0, [5], 4, table)])
    assert all(np.array_equal(np.array(a), b) for a, b in zip(runner.kvstore.arrays(), written))
    assert any(not np.array_equal(a, b) for a, b in zip(written, before))


def test_bucket_widths():
    assert [bucket_pages(n) for n in (1, 3, 4, 5, 8, 9, 100)] == [4, 4, 4, 8, 8, 16, 128]
    assert compiled_decode.MIN_BUCKET_PAGES == 4


def test_row_buckets():
    assert [bucket_rows(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 12]
    assert [bucket_rows(n) for n in (12, 13, 32, 33, 40, 41, 64)] == [12, 16, 32, 40, 40, 48, 64]
    assert len({bucket_rows(n) for n in range(1, 65)}) == 14


def test_a_shrinking_batch_pads_its_rows_and_writes_only_its_own_slots(tiny_llama):
    """Rows padded to a bucket by repeating the last row: the real rows' logits and every page
    equal the uncompiled runner's (a padding row writing anywhere but its original's slot would
    differ), and a batch shrinking 7 -> 1 costs 4 traces (8, 4, 2, 1 rows), not 7."""
    lm = load_model(tiny_llama)
    rng = np.random.default_rng(3)
    order = rng.permutation(40).tolist()
    tables = [order[5 * i:5 * i + 5] for i in range(7)]
    runners = {k: _runner(lm, kernels, page_tokens=8) for k, kernels in (
        ("buckets", COMPILED), ("exact", KernelChoices(compiled_decode=True,
                                                        compiled_row_buckets=False)),
        ("plain", PLAIN))}
    prompts = [rng.integers(0, lm.geometry.vocab_size, 3 + 2 * i).tolist() for i in range(7)]
    for r in runners.values():
        r.forward([Chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    lens = [len(p) for p in prompts]
    for rows in range(7, 0, -1):   # one decode step per batch size, the last row leaving
        chunks = [Chunk(i, [5 + i], lens[i], tables[i]) for i in range(rows)]
        got = {k: np.array(r.forward(chunks)) for k, r in runners.items()}
        assert got["buckets"].shape[0] == rows
        for k in ("buckets", "exact"):
            assert np.abs(got[k] - got["plain"]).max() <= 1e-4, (k, rows)
        lens = [n + 1 for n in lens]
    for x, y in zip(runners["buckets"].kvstore.arrays(), runners["plain"].kvstore.arrays()):
        assert mx.abs(x - y).max().item() <= 1e-4
    assert runners["buckets"].compiled.traces == 4
    assert runners["exact"].compiled.traces == 7


def test_runner_refuses_compiled_steps_that_would_not_fit(tiny_model_dirs):
    # Sliding-window layers (gemma3) read a window the trace does not model.
    lm = load_model(tiny_model_dirs["gemma3_text"])
    assert not CompiledDecode.fits(_runner(lm, PLAIN))
    assert _runner(lm, COMPILED).compiled is None
    # Packed stores attend over codes through their own cache class.
    from engine.attention.layers import packed_layer_factory
    llama = load_model(tiny_model_dirs["llama"])
    store = KVStore(llama.geometry, 16, 16, llama.dtype,
                    layer_factory=packed_layer_factory("int8", "direct", lambda n: True))
    assert ModelRunner(llama, store, kernels=COMPILED).compiled is None
    # The CPU default: no CUDA decode kernel, so no compiled steps.
    assert _runner(llama, KernelChoices()).compiled is None


def test_engine_with_compiled_steps_generates_what_the_plain_engine_does(tiny_llama):
    def build(kernels, pipelined, **cfg):
        cls = type("E", (Engine,), {"pipeline_decode": pipelined})
        return cls(EngineConfig(model=tiny_llama, kv_budget_bytes=64 * PAGE_BYTES_LLAMA,
                                page_tokens=16, max_step_tokens=64, **cfg), kernels=kernels)

    async def batch(eng):
        import asyncio
        rs = [req("a", n_prompt=21, pseed=1, max_tokens=40, ignore_eos=True),
              req("b", n_prompt=5, pseed=2, max_tokens=9, ignore_eos=True),
              req("c", n_prompt=12, pseed=5, max_tokens=30, ignore_eos=True,
                  temperature=0.9, top_p=0.95, seed=1234),
              req("d", n_prompt=9, pseed=7, max_tokens=32)]
        return [tokens(d) for d in await asyncio.gather(*(collect(eng, r) for r in rs))]

    # Compiled by the model's config (the serving path) and by the kernel choices (benches).
    engines = [build(PLAIN, True, compiled_decode=True), build(COMPILED, False),
               build(PLAIN, True), build(PLAIN, False)]
    try:
        outs = [run(batch(e)) for e in engines]
        assert outs[0] == outs[1] == outs[2] == outs[3]
        for e in engines[:2]:   # the compiled path really ran
            assert e._parts.runner.compiled.traces >= 1
        assert engines[2]._parts.runner.compiled is None
        for e in engines:
            s = wait_idle(e)
            assert s.kv_pages_used == 0
    finally:
        for e in engines:
            e.shutdown()


def test_a_model_the_trace_cannot_follow_falls_back_to_uncompiled_steps(tiny_llama, monkeypatch,
                                                                         caplog):
    # A fake fault: no model at hand breaks the trace, so one is made to (its attention asks
    # the step for something a compiled step cannot answer).
    class UntraceableModel(Exception):
        pass

    def refuse(self, window):
        raise UntraceableModel("this model wants host-side key ranges")
    monkeypatch.setattr(compiled_decode.DeviceDecodeStep, "view", refuse)
    lm = load_model(tiny_llama)
    broken, plain = _runner(lm, COMPILED), _runner(lm, PLAIN)
    assert broken.compiled is not None
    with caplog.at_level("WARNING", logger="orchard.engine"):
        a = _decode(broken, [[5, 6, 7, 8]], [[3, 1, 4]], 6, lazy=True)
    b = _decode(plain, [[5, 6, 7, 8]], [[3, 1, 4]], 6, lazy=True)
    assert max(np.abs(x - y).max() for x, y in zip(a, b)) <= 1e-5   # nothing half-written
    assert broken.compiled is None   # off for good after the first failed trace
    assert "compiled decode steps off" in caplog.text and "host-side key ranges" in caplog.text


def test_mixed_step_decode_rows_take_the_compiled_step(tiny_model_dirs):
    """A step mixing a prefill chunk with decode rows runs its decode rows through the compiled
    step (one trace, counted as one model call) and computes what the uncompiled runner does."""
    lm = load_model(tiny_model_dirs["llama"])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in (9, 14)]
    tables = [[3, 7, 1, 12], [5, 0, 9, 2], [8, 4, 11, 6, 10, 13]]
    newcomer = rng.integers(0, lm.geometry.vocab_size, 21).tolist()
    results = []
    # One call per group (merged steps off): the decode rows' own call is what is compared.
    for kernels in (COMPILED, KernelChoices(compiled_decode=False, merged_steps=False)):
        # Allowance 0: the newcomer's chunk and the decode rows never share a call.
        r = ModelRunner(lm, KVStore(lm.geometry, 40, 8, lm.dtype), merge_pad_tokens=0,
                        kernels=kernels)
        first = r.forward([Chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
        ids = np.array(mx.argmax(first, axis=-1)).tolist()
        calls, traces = r.model_calls, r.compiled.traces if r.compiled else 0
        mixed = r.forward([Chunk(0, [ids[0]], 9, tables[0]), Chunk(2, newcomer, 0, tables[2]),
                           Chunk(1, [ids[1]], 14, tables[1])])
        results.append((np.array(mixed), r.model_calls - calls,
                        (r.compiled.traces if r.compiled else 0) - traces))
    (fast, fast_calls, fast_traces), (slow, slow_calls, _) = results
    assert np.abs(fast - slow).max() <= 1e-4
    assert fast_calls == slow_calls == 2       # the prefill chunk's call + the decode rows' call
    assert fast_traces == 1                    # the decode rows went through the compiled step


def test_merge_padding_default_follows_the_device(tiny_llama):
    lm = load_model(tiny_llama)
    store = KVStore(lm.geometry, 8, 8, lm.dtype)
    from engine.runner.paged import CPU_MERGE_PAD_TOKENS
    assert mx.default_device() == mx.cpu
    assert ModelRunner(lm, store).merge_pad_tokens == CPU_MERGE_PAD_TOKENS
    assert ModelRunner(lm, store, merge_pad_tokens=300).merge_pad_tokens == 300
    with pytest.raises(ValueError, match="merge_pad_tokens"):
        EngineConfig(model=tiny_llama, merge_pad_tokens=-1)
