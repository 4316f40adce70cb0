"""Page-key prefill chunks over short history on the CPU attend as native prefill over a
dequantized copy (PackedLayerCache._cpu_page_key_prefill_attend): the direct path's logits, and
only where the history fits one CPU tile."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import packed_cache
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_over_history_matches_the_tiled_path(tiny_model_dirs, arch, fmt, monkeypatch):
    lm = load_model(tiny_model_dirs[arch])
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in (50, 2 * T, 9)]
    tables = [[5, 1, 3, 8], [7, 2, 9, 12], [11, 4, 0, 13]]
    new = PackedModelRunner(lm, tail_store(lm, fmt))
    old = PackedModelRunner(lm, tail_store(lm, fmt), kernels=KernelChoices(cpu_softmax=False))
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
    runner = PackedModelRunner(lm, tail_store(lm, "k6v4-kivi"))
    calls = record_calls(monkeypatch, PackedLayerCache, "_cpu_page_key_prefill_attend",
                         lambda cache: int(cache.step.starts.max()))
    for start in range(0, 4 * T, T):
        mx.eval(runner.forward([Chunk(0, prompt[start:start + T], start, [3, 1, 4, 5])]))
    layers = sum(s.packed for s in runner.kvstore.layers.values())
    assert calls == [T] * layers + [2 * T] * layers   # 3T: three pages of history, past it
