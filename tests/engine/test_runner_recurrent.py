"""Hybrid models keep working: recurrent layers (LFM2's short convolutions) keep mlx-lm's native
per-sequence state while attention layers are paged, batched with rows of other lengths."""
from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from engine.kv.store import KVStore
from engine.model.loader import load_model
from engine.runner.paged import ModelRunner
from engine.sched.seq import Chunk
from bench.synthetic import SPECIAL_TOKENS, build_tokenizer

LFM2 = dict(model_type="lfm2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5,
            conv_bias=False, conv_L_cache=3, block_dim=128, block_multiple_of=32,
            block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, block_ff_dim=256,
            layer_types=["conv", "full_attention", "conv", "full_attention"], eos_token_id=0)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("lfm2")
    build_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = {**LFM2, "vocab_size": len(vocab) + len(SPECIAL_TOKENS)}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    params = {k: (v * 2.0 if v.ndim >= 2 else v) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text(json.dumps(config))
    return load_model(out)


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
