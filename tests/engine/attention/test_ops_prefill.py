"""Prefill attention through MLX ops (engine/attention/ops_prefill.py) gives mx.fast SDPA's
results, and the runner takes it where KernelChoices.prefill_attention says: "ops" on any
backend, "auto" only on CUDA (where SDPA builds a cuDNN plan per shape), never for calls whose
scores exceed the ops budget."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import ops_prefill
from engine.attention.choices import KernelChoices
from engine.config import EngineConfig
from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from tests.engine.attention.runner_pairs import ARCHS
from tests.engine.attention.runner_pairs import chunked_prefill


def _qkv(b, hq, hkv, n, s, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    return tuple(mx.random.normal(shape).astype(dtype)
                 for shape in ((b, hq, n, 16), (b, hkv, s, 16), (b, hkv, s, 16)))


@pytest.mark.parametrize("n,s", [(7, 7), (40, 100), (3, 517)])
def test_causal_matches_mlx(n, s):
    q, k, v = _qkv(1, 6, 2, n, s)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    got = ops_prefill.ops_attention(q, k, v, 0.25, "causal")
    assert got.shape == ref.shape
    assert mx.abs(got - ref).max().item() <= 1e-5


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.bfloat16, 3e-2)])
def test_array_mask_and_no_mask_match_mlx(dtype, tol):
    q, k, v = _qkv(3, 4, 2, 9, 20, dtype, seed=1)
    keep = np.random.default_rng(0).random((3, 1, 9, 20)) < 0.6
    keep[..., 0] = True                       # no fully masked query row (as the runner's)
    for m in (mx.array(keep), None):
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=m)
        got = ops_prefill.ops_attention(q, k, v, 0.5, m)
        assert got.dtype == dtype
        assert mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item() <= tol


def test_bf16_scores_stay_float32_as_flash_attention_keeps_them():
    # Large logits (q, k ~ N(0, 4)) make bf16 score rounding visible: against float32 attention
    # over the same bf16 inputs, scores rounded to bf16 before the softmax were off by
    # 0.041-0.052 on these draws, float32 scores by 0.011-0.013 (the output's own rounding and
    # bf16 weights in the PV matmul, as cuDNN's flash attention has them).
    for seed in range(3):
        mx.random.seed(seed)
        q = (2 * mx.random.normal((1, 8, 64, 64))).astype(mx.bfloat16)
        k = (2 * mx.random.normal((1, 2, 300, 64))).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, 300, 64)).astype(mx.bfloat16)
        ref = mx.fast.scaled_dot_product_attention(
            *(x.astype(mx.float32) for x in (q, k, v)), scale=0.125, mask="causal")
        got = ops_prefill.ops_attention(q, k, v, 0.125, "causal")
        assert got.dtype == mx.bfloat16
        assert mx.abs(got.astype(mx.float32) - ref).max().item() < 0.02


def test_score_budget_bounds_the_ops_path():
    q, k, _ = _qkv(2, 4, 2, 8, 32)
    assert ops_prefill.use_ops(q, k, limit=2 * 4 * 8 * 32)
    assert not ops_prefill.use_ops(q, k, limit=2 * 4 * 8 * 32 - 1)
    assert not ops_prefill.use_ops(q[:, :, :1], k)          # one query row: decode paths


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="prefill_attention"):
        KernelChoices(prefill_attention="flash")
    with pytest.raises(ValueError, match="prefill_attention"):
        EngineConfig(model="m", prefill_attention="flash")


@pytest.mark.parametrize("arch", ARCHS)
def test_runner_prefill_through_ops_matches_fast(tiny_model_dirs, arch, monkeypatch):
    lm = load_model(tiny_model_dirs[arch])
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, lm.geometry.vocab_size, n).tolist() for n in (45, 12, 30)]

    def runner(choice):
        return ModelRunner(lm, KVStore(lm.geometry, 24, 16, lm.dtype),
                           kernels=KernelChoices(cpu_softmax=False, cpu_prefill=False,
                                                prefill_attention=choice))

    ops, fast, auto = runner("ops"), runner("fast"), runner("auto")
    # "auto" is ops only on CUDA: this suite runs on the CPU.
    assert ops.prefill_ops and not fast.prefill_ops and not auto.prefill_ops
    calls = []
    real = ops_prefill.ops_attention
    monkeypatch.setattr(ops_prefill, "ops_attention",
                        lambda q, *a: calls.append(q.shape[2]) or real(q, *a))
    ref = chunked_prefill(fast, prompts)
    assert not calls
    got = chunked_prefill(ops, prompts)
    # Every multi-token call of a paged layer without sinks took it; gpt_oss's sinks never.
    assert (not calls) if arch == "gpt_oss" else calls and min(calls) > 1
    for a, b in zip(got, ref):
        assert mx.abs(a - b).max().item() <= 1e-4
        assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1))
    # Over the budget, the same runner takes mx.fast's SDPA again.
    calls.clear()
    monkeypatch.setattr(ops_prefill, "OPS_SCORE_ELEMENTS", 1)
    chunked_prefill(runner("ops"), prompts)
    assert not calls
