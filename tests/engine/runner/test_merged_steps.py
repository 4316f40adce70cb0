"""Mixed steps in one pass over the weights (engine/runner/merged.py): the same logits and
pages as one model call per row group, one call per step, and only where it fits."""
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.choices import DEFAULT_KERNELS
from engine.attention.layers import packed_layer_factory
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk

PAGES = 6   # per sequence, 16 tokens each


def _runner(loaded, merged: bool, **store_kw) -> ModelRunner:
    store = KVStore(loaded.geometry, 4 * PAGES, 16, loaded.dtype, **store_kw)
    return ModelRunner(loaded, store, kernels=replace(DEFAULT_KERNELS, merged_steps=merged))


def _steps(vocab: int):
    """Four sequences: two prompts prefilled in chunks while two others decode, so most steps
    mix a long chunk, a short chunk and one-token rows (three groups)."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, vocab, n).tolist() for n in (40, 23, 9, 5)]
    tables = [list(range(i * PAGES, (i + 1) * PAGES)) for i in range(4)]
    yield [Chunk(2, prompts[2], 0, tables[2]), Chunk(3, prompts[3], 0, tables[3])]
    pos = {0: 0, 1: 0, 2: 9, 3: 5}
    for step in range(4):
        chunks = []
        for seq, size in ((0, 17), (1, 6)):
            if pos[seq] < len(prompts[seq]):
                ids = prompts[seq][pos[seq]:pos[seq] + size]
                chunks.append(Chunk(seq, ids, pos[seq], tables[seq]))
                pos[seq] += len(ids)
        for seq in (2, 3):
            chunks.append(Chunk(seq, [7 + step], pos[seq], tables[seq]))
            pos[seq] += 1
        yield chunks[::-1] if step % 2 else chunks   # chunk order is not group order


def test_mixed_steps_match_one_call_per_group(tiny_llama):
    loaded = load_model(tiny_llama)
    merged, plain = _runner(loaded, True), _runner(loaded, False)
    assert merged.merged is not None and plain.merged is None
    for chunks in _steps(loaded.geometry.vocab_size):
        calls = (merged.model_calls, plain.model_calls)
        a, b = merged.forward(chunks), plain.forward(chunks)
        assert a.shape == b.shape == (len(chunks), loaded.geometry.vocab_size)
        assert mx.abs(a - b).max().item() < 1e-4
        assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()
        groups = len(plain._groups(chunks))
        assert merged.model_calls - calls[0] == 1
        assert plain.model_calls - calls[1] == groups
    # Every group wrote its keys and values to its own pages, as the per-group calls did.
    for x, y in zip(merged.kvstore.arrays(), plain.kvstore.arrays()):
        assert mx.abs(x - y).max().item() < 1e-4


@pytest.mark.parametrize("case", ["packed", "qwen3", "off"])
def test_merged_only_where_it_fits(tiny_model_dirs, case):
    if case == "qwen3":   # not a plain mlx-lm Llama: its own forward, one call per group
        runner = _runner(load_model(tiny_model_dirs["qwen3"]), True)
    elif case == "packed":   # native sink rows per page: per-group calls (other packed
        # formats merge: tests/engine/runner/test_merged_packed.py)
        runner = _runner(load_model(tiny_model_dirs["llama"]), True,
                         layer_factory=packed_layer_factory("int4-sink"))
    else:
        runner = _runner(load_model(tiny_model_dirs["llama"]), False)
    assert runner.merged is None


def test_production_choices_merge_on_the_cpu(tiny_llama):
    """The default KernelChoices take the merged path wherever it fits (here: the CPU)."""
    loaded = load_model(tiny_llama)
    runner = ModelRunner(loaded, KVStore(loaded.geometry, 8, 16, loaded.dtype))
    assert runner.merged is not None
