"""Hybrid models keep working: recurrent layers (LFM2's short convolutions) keep mlx-lm's native
per-sequence state while attention layers are paged, batched with rows of other lengths."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk
from tests.engine_helpers import LFM2, random_model


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return load_model(random_model(tmp_path_factory.mktemp("lfm2"), LFM2, weight_scale=2.0))


def test_geometry_marks_conv_layers_recurrent_and_unpaged(lfm2):
    assert [g.kind for g in lfm2.geometry.layers] == ["recurrent", "full"] * 2
    assert lfm2.geometry.paged_layers == (1, 3)
    # Each conv layer keeps its last conv_L_cache - 1 inputs: 2 x hidden float32 per sequence.
    assert lfm2.geometry.state_bytes_per_sequence == 2 * (2 * 128 * 4)
    store = KVStore(lfm2.geometry, 4, 16, lfm2.dtype)
    assert sorted(store.layers) == [1, 3]


def test_chunked_batched_logits_match_mlx_lm(lfm2):
    runner = ModelRunner(lfm2, KVStore(lfm2.geometry, 16, 16, lfm2.dtype))
    assert runner.direct
    rng = np.random.default_rng(0)
    plans = {0: [7, 20, 1, 1], 1: [1, 3, 25, 1], 2: [30, 1, 1, 9]}
    prompts = {s: rng.integers(0, lfm2.geometry.vocab_size, sum(p)).tolist()
               for s, p in plans.items()}
    tables = {0: [3, 0, 7], 1: [5, 1, 9], 2: [2, 8, 4]}
    got = {s: [] for s in plans}
    done = dict.fromkeys(plans, 0)
    for step in range(4):
        chunks = []
        for s, plan in plans.items():
            n = plan[step]
            chunks.append(Chunk(s, prompts[s][done[s]:done[s] + n], done[s], tables[s]))
            done[s] += n
        for s, logits in zip(plans, runner.forward_all(chunks)):
            got[s].append(logits)
    for s in plans:
        ref = lfm2.model(mx.array([prompts[s]]), cache=make_prompt_cache(lfm2.model))[0]
        assert mx.abs(mx.concatenate(got[s]) - ref).max().item() <= 1e-3


def test_state_resets_at_token_zero_and_cannot_resume_unknown_sequences(lfm2):
    runner = ModelRunner(lfm2, KVStore(lfm2.geometry, 4, 16, lfm2.dtype))
    tokens = list(range(5, 25))
    first = runner.forward([Chunk(0, tokens, 0, [0, 1])])
    again = runner.forward([Chunk(0, tokens, 0, [2, 3])])  # a recompute from scratch
    assert mx.abs(first - again).max().item() == 0.0
    runner.release(0)
    with pytest.raises(ValueError, match="start at token 0"):
        runner.forward([Chunk(0, [1], 20, [2, 3])])
