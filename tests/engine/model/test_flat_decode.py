"""Llama decode steps on [rows, hidden] (engine/model/flat_decode.py) inside compiled steps.

What they pin: the flat forward computes exactly what the model's own forward computes (logits
and written pages, step by step, fused and unfused projections, uneven rows); it applies only
to plain mlx-lm Llama models; and it takes the view nodes it exists to remove out of the step's
graph (counted, never timed).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.attention.choices import KernelChoices
from engine.kv.store import KVStore
from engine.model.flat_decode import flat_decode_body
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk

pytestmark = pytest.mark.unit

FLAT = KernelChoices(compiled_decode=True, flat_decode=True)
MODEL_FORWARD = KernelChoices(compiled_decode=True, flat_decode=False)
# Uncompiled steps (the CPU's default) take the flat forward too (ModelRunner.call_model).
FLAT_UNCOMPILED = KernelChoices(compiled_decode=False, flat_decode=True)
MODEL_UNCOMPILED = KernelChoices(compiled_decode=False, flat_decode=False)


def _steps(lm, kernels, steps=12):
    """Prefill three uneven prompts, then greedy compiled decode steps: every step's logits and
    the pages after the last."""
    runner = ModelRunner(lm, KVStore(lm.geometry, 40, 8, lm.dtype), kernels=kernels)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in (5, 30, 17)]
    tables = [[31, 2, 17, 8, 25, 11, 0], [5, 22, 14, 39, 1, 28, 9], [12, 33, 3, 26, 7, 20, 38]]
    logits = runner.forward([Chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    lens, out = [len(p) for p in prompts], []
    for _ in range(steps):
        toks = np.array(mx.argmax(logits, axis=-1)).tolist()
        logits = runner.forward([Chunk(i, [toks[i]], lens[i], tables[i]) for i in range(3)])
        out.append(np.array(logits))
        lens = [n + 1 for n in lens]
    return runner, out, [np.array(a) for a in runner.kvstore.arrays()]


@pytest.mark.parametrize("fuse", [True, False])
def test_flat_steps_equal_the_models_own_forward(tiny_llama, fuse):
    lm = load_model(tiny_llama, fuse=fuse)
    flat, a, pages_a = _steps(lm, FLAT)
    plain, b, pages_b = _steps(lm, MODEL_FORWARD)
    assert flat.compiled is not None and plain.compiled is not None
    assert flat.flat is not None and plain.flat is None
    for step, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), step
    for x, y in zip(pages_a, pages_b):
        assert np.array_equal(x, y)


def test_uncompiled_flat_steps_equal_the_models_own_forward(tiny_llama):
    lm = load_model(tiny_llama)
    flat, a, pages_a = _steps(lm, FLAT_UNCOMPILED)
    plain, b, pages_b = _steps(lm, MODEL_UNCOMPILED)
    assert flat.compiled is None and flat.flat is not None and plain.flat is None
    for step, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), step
    for x, y in zip(pages_a, pages_b):
        assert np.array_equal(x, y)


def test_only_plain_llama_models_take_it(tiny_model_dirs):
    assert flat_decode_body(load_model(tiny_model_dirs["llama"]).model) is not None
    assert flat_decode_body(load_model(tiny_model_dirs["qwen3"]).model) is None


def test_the_step_graph_loses_the_flatten_pairs_and_transposes(tiny_llama):
    """bench/decode_graph.py's count of one layer's traced nodes, GPU choices with stand-ins:
    no Flatten/Unflatten around the matmuls and no transposes of q, k, v or the output."""
    from bench.decode_graph import engine_side

    layer = engine_side(tiny_llama, "engine", 20, 8, with_issued=False)["traced"]["per_layer"]
    prims = layer["by_primitive"]
    assert not {"Flatten", "Unflatten", "Transpose"} & set(prims), prims
    assert prims["Matmul"]["n"] == 4 and prims["CustomKernel:native_tiled_decode_own"]["n"] == 1
    assert layer["nodes"] <= 20
