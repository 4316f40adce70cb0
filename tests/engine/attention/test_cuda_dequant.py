"""The history-dequant prefill path (engine/attention/cuda/packed_dequant.py) on the CPU.

Its kernel's CUDA source runs on the CPU emulator (bench/cuda_emulate.py: one fiber per GPU
thread, the real source text compiled with g++), followed by MLX's SDPA here, through the
device check's prefill cases (bench/cuda_check.py: ragged rows, one without history, NaN in the
chunk padding, decode-shaped rows) against the engine's direct packed attention. On the GPU
the same cases run as `python -m bench.cuda_check --kernels dequant`. Also: the joint mask, the
kernel choice, and that a CPU runner never routes to the path.
"""
from __future__ import annotations

import functools
import shutil

import mlx.core as mx
import numpy as np
import pytest

from bench import cuda_check, cuda_emulate
from engine.attention.choices import KernelChoices
from engine.attention.cuda import packed_dequant
from engine.attention.cuda import packed_prefill

pytestmark = pytest.mark.gpu


def _emulated(workdir):
    history = functools.partial(cuda_emulate.packed_dequant, workdir=workdir)
    return functools.partial(packed_dequant.dequant_prefill_attention, history=history)


@pytest.mark.parametrize("fmt", ["int8", "int4", "k8v4"])
def test_kernel_source_on_cpu_fibers_matches_direct_packed_attention(fmt, tmp_path):
    assert shutil.which("g++"), "the CPU emulation of the CUDA kernel compiles with g++"
    rng = np.random.default_rng(5)
    for hq, kvh, d, history, own in ((4, 2, 64, [40, 0, 75], [9, 17, 1]),
                                     (4, 1, 128, [33], [20]), (3, 3, 64, [50, 20], [1, 1]),
                                     (8, 2, 128, [100], [64])):
        case = cuda_check.prefill_case(rng, fmt, hq, kvh, d, history, own,
                                       kernel=_emulated(tmp_path))
        assert case["ok"] and case["max_abs_err"] < 0.02, case   # bf16 output rounding


def test_a_wrong_kernel_fails_the_cases(tmp_path, monkeypatch):
    """A kernel that reads each key's scale as its offset and the other way round fails."""
    broken = packed_dequant._SOURCE.replace("* sc + of", "* of + sc")
    assert broken != packed_dequant._SOURCE
    monkeypatch.setattr(packed_dequant, "_SOURCE", broken)
    case = cuda_check.prefill_case(np.random.default_rng(5), "int8", 4, 2, 64, [40, 0],
                                   [9, 17], kernel=_emulated(tmp_path))
    assert not case["ok"], case


def test_joint_mask():
    assert packed_dequant.joint_mask(np.array([5, 5]), np.array([3, 3]), 3) == "causal"
    assert packed_dequant.joint_mask(np.array([5]), np.array([1]), 1) is None
    # Row 0: 2 history keys, 3 own; row 1: none, 1 own (its padded positions see key 0 only).
    got = np.array(packed_dequant.joint_mask(np.array([2, 0]), np.array([3, 1]), 3))
    assert got.shape == (2, 1, 3, 5)
    assert got[0, 0].astype(int).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                              [1, 1, 1, 1, 1]]
    assert got[1, 0].astype(int).tolist() == [[0, 0, 1, 0, 0]] * 3


def test_choice_is_validated_and_never_routes_on_the_cpu(tiny_llama):
    from engine.attention.layers import packed_layer_factory
    from engine.attention.paged import StepBatch
    from engine.sched.seq import Chunk
    from engine.kv.store import KVStore
    from engine.model.loader import load_model

    with pytest.raises(ValueError, match="prefill_path"):
        KernelChoices(prefill_path="magic")
    kernels = KernelChoices(prefill_path="dequant")
    lm = load_model(tiny_llama)
    store = KVStore(lm.geometry, 4, 16, lm.dtype,
                    layer_factory=packed_layer_factory("int4", kernels=kernels)).layer(0)
    step = StepBatch([Chunk(0, [0] * 8, 16, [0, 1])], 16)
    q = mx.zeros((1, 4, 8, store.geometry.head_dim))
    # The path is taken where the tile kernel would be: never without CUDA.
    assert not packed_prefill.applies(store, step, q, kernel_decode=True, kernels=kernels)
