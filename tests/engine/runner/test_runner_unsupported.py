"""A model with a layer cache the engine can neither page nor batch refuses to load.

The case is real: mlx-lm's llama4 gives three of every four layers a ChunkedKVCache (attention
within fixed chunks), which the geometry probe classifies as kind "other". A tiny random-weight
llama4 is built offline here, like the fixtures in bench/synthetic.py.
"""
import json

import pytest

from engine.config import EngineConfig
from engine.kv.store import KVStore
from engine import Engine
from engine.model.loader import ModelLoadError, load_model
from engine.runner.paged import ModelRunner
from bench.synthetic import SPECIAL_TOKENS, build_tokenizer

REFUSAL = (r"layers 0, 1, 2 keep a ChunkedKVCache \(cache kind 'other'\).*paged attention "
           r"\(full or sliding window\) or per-sequence recurrent state only")


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory) -> str:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes as get_model_classes

    out = tmp_path_factory.mktemp("tiny_llama4")
    build_tokenizer(out)
    vocab = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    text = dict(model_type="llama4_text", attention_bias=False, attention_chunk_size=16,
                head_dim=64, hidden_size=128, interleave_moe_layer_step=2, intermediate_size=128,
                intermediate_size_mlp=256, max_position_embeddings=4096, num_attention_heads=4,
                num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2,
                num_local_experts=2, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0,
                use_qk_norm=True, vocab_size=vocab + len(SPECIAL_TOKENS))
    config = {"model_type": "llama4", "text_config": text, "eos_token_id": 0}
    model_cls, args_cls = get_model_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_probe_finds_the_chunked_layers(tiny_llama4):
    kinds = [g.kind for g in load_model(tiny_llama4).geometry.layers]
    assert kinds == ["other", "other", "other", "full"]


def test_engine_refuses_the_model_with_a_model_load_error(tiny_llama4):
    with pytest.raises(ModelLoadError, match=REFUSAL):
        Engine(EngineConfig(model=tiny_llama4, kv_budget_bytes=1 << 20, page_tokens=16))


def test_runner_refuses_the_model_too(tiny_llama4):
    loaded = load_model(tiny_llama4)
    store = KVStore(loaded.geometry, 4, 16, loaded.dtype)
    with pytest.raises(ModelLoadError, match=REFUSAL):
        ModelRunner(loaded, store)
