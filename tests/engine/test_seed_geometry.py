"""The seed's load-time rules for packed KV, through the real Engine on tiny models: a format the
model cannot store is refused when the engine is built (before any KV memory is sized, long
before the replica's warm-up forward), and a recurrent model's per-sequence state is charged."""
from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.llama as llama_module
import pytest

from bench.synthetic import build_tiny_model
from capacity.formats import KVFormatError
from engine import Engine
from engine.config import EngineConfig
from tests.engine_helpers import (LFM2, collect, random_model, req, run, started, tokens,
                                  wait_idle)

BUDGET = 1 << 22


def engine(model_dir, kv_format, **kw):
    return Engine(EngineConfig(model=str(model_dir), kv_format=kv_format, page_tokens=16,
                               kv_budget_bytes=BUDGET, **kw))


@pytest.fixture(scope="module")
def llama_d192(tmp_path_factory):
    # head_dim 192: groups of 64 divide it, the rotation's Hadamard blocks of 128 do not.
    return build_tiny_model("llama", tmp_path_factory.mktemp("d192"), head_dim=192)


# RecurrentGemma (Griffin): RG-LRU recurrent blocks and local (sliding-window) attention, no
# full-attention layer at all: a real architecture a packed format has nothing to pack in.
RECURRENT_GEMMA = dict(model_type="recurrent_gemma", attention_bias=False, conv1d_width=4,
                       hidden_size=128, intermediate_size=256, logits_soft_cap=30.0,
                       num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1,
                       rms_norm_eps=1e-6, rope_theta=10000.0, attention_window_size=16,
                       block_types=["recurrent", "attention"], lru_width=128, eos_token_id=0)


@pytest.fixture(scope="module")
def no_full_attention(tmp_path_factory):
    return random_model(tmp_path_factory.mktemp("rgemma"), RECURRENT_GEMMA)


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory):
    # Two heads of 64 (LFM2's test geometry has 32: too narrow for packed groups of 64).
    return random_model(tmp_path_factory.mktemp("lfm2"),
                        {**LFM2, "num_attention_heads": 2, "num_key_value_heads": 1})


@pytest.mark.parametrize("fmt", ["int8", "k8v4", "int4", "int4-sink", "int4-tail"])
def test_rotated_format_on_a_head_dim_its_rotation_cannot_tile_is_refused_at_load(
        llama_d192, fmt):
    with pytest.raises(KVFormatError, match=r"Hadamard blocks of min\(128, head_dim\) = 128 "
                                            r"channels.*head_dim 192"):
        engine(llama_d192, fmt)


def test_the_same_head_dim_serves_native(llama_d192):
    eng = engine(llama_d192, "native")
    try:
        out = run(collect(eng, req("a", max_tokens=4, ignore_eos=True)))
        assert len(tokens(out)) == 4
    finally:
        eng.shutdown()


def test_packed_format_on_a_model_without_full_attention_is_refused(no_full_attention):
    with pytest.raises(KVFormatError, match=r"int4 packs full-attention layers only and this "
                                            r"model has none \(layer kinds: \['recurrent', "
                                            r"'sliding'\]\)"):
        engine(no_full_attention, "int4")
    eng = engine(no_full_attention, "native")   # what the error tells the user to do works
    try:
        assert len(tokens(run(collect(eng, req("a", max_tokens=3, ignore_eos=True))))) == 3
    finally:
        eng.shutdown()


def test_packed_format_on_attention_that_bypasses_the_hook_is_refused(tiny_llama, monkeypatch):
    """A fake, said so: no architecture mlx-lm ships here calls mx.fast's attention directly,
    so llama's attention is patched to (the way a model bypassing the hook would run)."""
    monkeypatch.setattr(llama_module, "scaled_dot_product_attention",
                        lambda q, k, v, cache, scale, mask, sinks=None:
                        mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    with pytest.raises(KVFormatError, match="packed KV needs every paged layer to attend "
                                            "through the SDPA hook"):
        engine(tiny_llama, "int4")
    eng = engine(tiny_llama, "native")     # native reads gathered keys instead: still serves
    try:
        assert len(tokens(run(collect(eng, req("a", max_tokens=3, ignore_eos=True))))) == 3
    finally:
        eng.shutdown()


@pytest.mark.parametrize("fmt", ["native", "int4"])
def test_recurrent_state_is_charged_per_request_on_a_recurrent_model(lfm2_dir, fmt):
    eng = engine(lfm2_dir, fmt)
    try:
        cm = eng.cost_model()
        # LFM2's two conv layers each keep conv_L_cache - 1 = 2 inputs of hidden 128 in float32.
        assert cm.fixed_bytes_per_request == 2 * (2 * 128 * 4)

        async def charged_while_running():
            agen, _ = await started(eng, req("r", n_prompt=20, max_tokens=12, ignore_eos=True))
            reserved = eng.stats().kv_bytes_reserved
            await agen.aclose()
            return reserved

        reserved = run(charged_while_running())
        pages = -(-(20 + 12) // 16)
        assert reserved == cm.charge_bytes(32) == (
            pages * 16 * cm.bytes_per_token + 2 * (2 * 128 * 4)
            + cm.workspace.per_token * pages * 16 + cm.workspace.per_request)
        wait_idle(eng)
    finally:
        eng.shutdown()
