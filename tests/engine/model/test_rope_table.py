"""RoPE by a per-position table (engine/model/rope_table.py) equals the rope modules' own
result, and CPU runners of Llama-family models rotate through it."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, Llama3RoPE

from engine.model import rope_table
from engine.model.loader import load_model
from engine.model.rope_table import RopeTable
from engine.sched.seq import Chunk

from tests.engine.attention.runner_pairs import assert_same_logits, runner_pair

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope,head_dim", [
    (nn.RoPE(64, base=100000), 64),
    (nn.RoPE(32, traditional=True, base=10000, scale=0.5), 32),
    (nn.RoPE(16, base=10000), 48),                      # partial rotary: 32 channels unrotated
    (Llama3RoPE(64, scaling_config=LLAMA3, base=500000), 64),
])
def test_rotation_equals_the_module(rope, head_dim):
    table = RopeTable(rope, head_dim)
    assert table.matches_module()
    # Rows at different offsets, several tokens each (a prefill call's shape).
    starts = np.array([0, 17, 5000])
    positions = starts[:, None] + np.arange(6)[None, :]
    x = mx.random.normal((3, 4, 6, head_dim), key=mx.random.key(1))
    got = table.rotation(positions).apply(x)
    for i, s in enumerate(starts):
        ref = rope(x[i:i + 1], offset=int(s))
        assert mx.abs(got[i:i + 1] - ref).max().item() <= 1e-5
    assert table.size >= 5006   # grew past its first 4,096 positions


def test_a_rope_whose_angles_depend_on_length_gets_no_table(tiny_llama):
    lm = load_model(tiny_llama)
    assert RopeTable.for_model(lm.model) is not None
    for layer in lm.model.model.layers:
        layer.self_attn.rope = DynamicNTKScalingRoPE(
            layer.self_attn.rope.dims, max_position_embeddings=64, traditional=False, base=10000,
            factor=2.0)
    assert RopeTable.for_model(lm.model) is None


def test_layers_that_rotate_differently_get_no_table(tiny_llama):
    lm = load_model(tiny_llama)
    layers = lm.model.model.layers
    layers[-1].self_attn.rope = nn.RoPE(layers[0].self_attn.rope.dims, base=1234.0)
    assert RopeTable.for_model(lm.model) is None


def _steps(runner, prompts):
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    out = [runner.forward([Chunk(i, t, 0, tables[i]) for i, t in enumerate(prompts)])]
    for s in range(3):
        out.append(runner.forward([Chunk(i, [7 + s], len(t) + s, tables[i])
                                   for i, t in enumerate(prompts)]))
    return out


def test_cpu_runner_rotates_by_the_table(tiny_llama, monkeypatch):
    lm, prompts, new, old = runner_pair(tiny_llama, 5, (40, 40, 40), cpu_rope_table=False)
    assert new.rope_table is not None and old.rope_table is None   # CPU suite, float32 pages
    applied = []
    real = rope_table.Rotation.apply
    monkeypatch.setattr(rope_table.Rotation, "apply",
                        lambda self, x: applied.append(x.shape) or real(self, x))
    got = _steps(new, prompts)
    # Prefill (width 40) and decode (width 1) calls, q and k of every layer.
    widths = {s[2] for s in applied}
    assert widths == {40, 1} and len(applied) == 4 * 2 * len(lm.model.model.layers)
    assert_same_logits(got, _steps(old, prompts))
