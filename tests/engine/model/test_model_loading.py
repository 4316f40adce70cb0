"""Loading: dtype policy, geometry probed from mlx-lm's own caches, fingerprint, no hub by default."""
from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from engine.model.loader import ModelLoadError, load_model, default_compute_dtype

EXPECTED_KINDS = {
    "llama": ["full", "full"],
    "qwen3": ["full", "full"],
    "gemma3_text": ["sliding", "sliding", "full"],
    "gpt_oss": ["sliding", "full"],
}


@pytest.mark.parametrize("arch", sorted(EXPECTED_KINDS))
def test_geometry_matches_the_architecture(tiny_model_dirs, arch):
    lm = load_model(tiny_model_dirs[arch])
    geo = lm.geometry
    assert [g.kind for g in geo.layers] == EXPECTED_KINDS[arch]
    assert all((g.kv_heads, g.head_dim, g.v_head_dim) == (2, 64, 64) for g in geo.layers)
    assert [g.window for g in geo.layers if g.kind == "sliding"] == \
        [16] * EXPECTED_KINDS[arch].count("sliding")
    assert geo.paged_layers == tuple(range(geo.num_layers)) and geo.unpaged_layers == ()
    assert geo.state_bytes_per_sequence == 0
    report = geo.describe()
    assert [r["paged"] for r in report] == [True] * geo.num_layers
    assert all(("last 16" in r["stores"]) == (r["kind"] == "sliding") for r in report)
    assert geo.vocab_size == json.loads(open(f"{tiny_model_dirs[arch]}/config.json").read())[
        "vocab_size"]
    assert lm.body is not None and lm.head is not None  # last-position LM head verified
    assert lm.tokenizer.encode("hello")


def test_cpu_backend_computes_in_float32_unless_overridden(tiny_llama):
    assert default_compute_dtype() == mx.float32  # tests run on the CPU backend
    lm = load_model(tiny_llama)
    assert lm.dtype == mx.float32 and lm.dtype_name == "float32"
    assert lm.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    half = load_model(tiny_llama, dtype="bfloat16")
    assert half.dtype == mx.bfloat16
    assert half.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    with pytest.raises(ModelLoadError):
        load_model(tiny_llama, dtype="int3")


def test_a_dtype_the_backend_cannot_run_is_a_clear_load_error(tiny_model_dirs):
    # gpt_oss experts use gather_mm, which MLX's CPU backend runs in float32 only.
    with pytest.raises(ModelLoadError, match="cannot run in"):
        load_model(tiny_model_dirs["gpt_oss"], dtype="bfloat16")


def test_fingerprint_is_stable_and_tracks_weights_and_config(tiny_llama, tmp_path):
    a = load_model(tiny_llama).fingerprint
    assert a == load_model(tiny_llama).fingerprint and len(a) == 16
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    assert load_model(copy).fingerprint == a  # content, not location
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    b = load_model(copy).fingerprint
    assert b != a
    weights = mx.load(str(copy / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    mx.save_safetensors(str(copy / "model.safetensors"), weights)
    assert load_model(copy).fingerprint not in (a, b)


def test_hub_ids_need_explicit_permission(tmp_path):
    with pytest.raises(ModelLoadError, match="allow_hub"):
        load_model("some-org/some-model")
    with pytest.raises(ModelLoadError, match="allow_hub"):
        load_model(str(tmp_path / "missing"))
