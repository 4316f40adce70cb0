"""Page-key prompt chunks on the CPU: through the prefill kernel that reads codes and native
tails where they lie (engine/attention/cpu_prefill.py, `page_key_prefill_attention`), first
chunks and chunks over history alike; with that kernel off, chunks over short history attend as
native prefill over a dequantized copy (PackedLayerCache._cpu_page_key_prefill_attend). Both give
the direct path's logits."""
from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import cpu_prefill, packed_cache
from engine.attention.choices import KernelChoices
from engine.attention.packed_cache import PackedLayerCache
from engine.model.loader import load_model
from engine.runner.packed import PackedModelRunner
from engine.sched.seq import Chunk
from tests.engine.attention.runner_pairs import assert_same_logits, record_calls
from tests.engine.kv.tail_helpers import T, tail_store

FORMATS = ["k6v4-kivi", "int4-kivi"]


def _run(runner, prompts, tables, chunk):
    """Every prompt prefilled `chunk` tokens a step (rows of one step at different starts: one
    starting, others with history ending mid-page or on a boundary), then two decode steps."""
    out, pos = [], [0] * len(prompts)
    while any(p < len(x) for p, x in zip(pos, prompts)):
        rows = [Chunk(i, x[p:p + chunk], p, t)
                for i, (p, x, t) in enumerate(zip(pos, prompts, tables)) if p < len(x)]
        out.append(runner.forward(rows))
        pos = [min(p + chunk, len(x)) for p, x in zip(pos, prompts)]
    for s in range(2):
        out.append(runner.forward([Chunk(i, [5 + s], len(x) + s, t)
                                   for i, (x, t) in enumerate(zip(prompts, tables))]))
    return out


def _case(model_dir, fmt, seed=6):
    """(model, prompts ending mid-page, on a page boundary and inside the first page, their
    page tables)."""
    lm = load_model(model_dir)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in (50, 2 * T, 9)]
    return lm, prompts, [[5, 1, 3, 8], [7, 2, 9, 12], [11, 4, 0, 13]]


# The MLX direct path with every CPU attention kernel off: the reference.
REFERENCE = KernelChoices(cpu_softmax=False, cpu_prefill=False, cpu_decode=False)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_prompt_chunks_take_the_kernel_and_match_the_direct_path(tiny_model_dirs, arch, fmt,
                                                                 monkeypatch):
    """Chunks of 12 tokens: first chunks, chunks over history ending mid-page or on a boundary,
    a chunk filling a page, rows of different lengths in one call; then decode steps."""
    lm, prompts, tables = _case(tiny_model_dirs[arch], fmt)
    new = PackedModelRunner(lm, tail_store(lm, fmt))
    old = PackedModelRunner(lm, tail_store(lm, fmt), kernels=REFERENCE)
    calls = record_calls(monkeypatch, cpu_prefill, "page_key_prefill_attention",
                         lambda store: store.fmt.name)
    got = _run(new, prompts, tables, 12)
    assert calls   # gemma3's sliding layers are native: only its full layers are page-key
    n = len(calls)
    assert_same_logits(got, _run(old, prompts, tables, 12))
    assert len(calls) == n   # the reference never took it


def test_a_split_call_equals_the_unsplit_one(tiny_model_dirs, monkeypatch):
    """A chunk with enough key reads runs its later queries on the parked worker thread,
    bit-identical (the threshold lowered to this tiny model's chunks)."""
    monkeypatch.setattr(cpu_prefill, "SPLIT_MIN_PAIRS", 64)
    lm = load_model(tiny_model_dirs["llama"])
    prompt = np.random.default_rng(8).integers(0, lm.geometry.vocab_size, 5 * T).tolist()
    table = [3, 1, 4, 5, 9, 2]

    def logits():
        runner = PackedModelRunner(lm, tail_store(lm, "k6v4-kivi"))
        return [np.asarray(runner.forward([Chunk(0, prompt[s:s + 2 * T + 3], s, table)]))
                for s in (0, 2 * T + 3)]

    monkeypatch.setattr(cpu_prefill, "SPLIT", False)
    whole = logits()
    monkeypatch.setattr(cpu_prefill, "SPLIT", True)
    real, threads = cpu_prefill.cpu_worker.parked_worker(), []

    class Recording:
        def submit(self, fn, *args):
            return real.submit(lambda *a: (threads.append(threading.get_ident()), fn(*a)),
                               *args)

    monkeypatch.setattr(cpu_prefill.cpu_worker, "parked_worker", lambda: Recording())
    split = logits()
    assert threads and threading.get_ident() not in threads
    assert all(np.array_equal(a, b) for a, b in zip(split, whole))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_over_history_matches_the_tiled_path(tiny_model_dirs, arch, fmt, monkeypatch):
    """With the prefill kernel off: the dequantized copy through native's NumPy softmax."""
    lm, prompts, tables = _case(tiny_model_dirs[arch], fmt)
    new = PackedModelRunner(lm, tail_store(lm, fmt), kernels=KernelChoices(cpu_prefill=False))
    old = PackedModelRunner(lm, tail_store(lm, fmt), kernels=KernelChoices(cpu_softmax=False,
                                                                           cpu_prefill=False))
    calls = record_calls(monkeypatch, PackedLayerCache, "_cpu_page_key_prefill_attend",
                         lambda cache: cache.step.starts.tolist())
    got = _run(new, prompts, tables, 12)
    assert calls and all(max(s) > 0 for s in calls)   # chunks over history took it
    n = len(calls)
    assert_same_logits(got, _run(old, prompts, tables, 12))
    assert len(calls) == n   # the reference never did


def test_long_history_keeps_the_tiled_path(tiny_model_dirs, monkeypatch):
    """Past one tile of history (CPU_PREFILL_COPY_KEYS) the chunk is scored tile by tile."""
    monkeypatch.setattr(packed_cache, "CPU_PREFILL_COPY_KEYS", 2 * T)
    lm = load_model(tiny_model_dirs["llama"])
    prompt = np.random.default_rng(7).integers(0, lm.geometry.vocab_size, 4 * T).tolist()
    runner = PackedModelRunner(lm, tail_store(lm, "k6v4-kivi"),
                               kernels=KernelChoices(cpu_prefill=False))
    calls = record_calls(monkeypatch, PackedLayerCache, "_cpu_page_key_prefill_attend",
                         lambda cache: int(cache.step.starts.max()))
    for start in range(0, 4 * T, T):
        mx.eval(runner.forward([Chunk(0, prompt[start:start + T], start, [3, 1, 4, 5])]))
    layers = sum(s.packed for s in runner.kvstore.layers.values())
    assert calls == [T] * layers + [2 * T] * layers   # 3T: three pages of history, past it
