"""Format arithmetic, identity grammar and the per-model KV policy (pure Python, no MLX)."""
import pytest

from capacity.format_names import format_from_identity, parse_identity
from capacity.formats import (
    KVFormat, KVFormatError, layer_format, normalize_format_name, resolve_kv_format,
    validate_policy)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name,bits_per_value", [("int8", 9), ("k8v4", 7), ("int4", 5)])
def test_bytes_per_token_is_codes_plus_fp32_metadata(name, bits_per_value, head_dim):
    fmt = KVFormat(name, head_dim, "bfloat16")
    native = KVFormat("native", head_dim, "bfloat16")
    # 64 values share an FP32 scale and an FP32 offset: +1 bit per value.
    assert fmt.bytes_per_token(kv_heads=8) * 8 == 8 * 2 * head_dim * bits_per_value
    assert native.bytes_per_token(8) == 8 * 2 * head_dim * 2
    ratio = native.bytes_per_token(8) / fmt.bytes_per_token(8)
    assert ratio == pytest.approx({"int8": 16 / 9, "k8v4": 16 / 7, "int4": 3.2}[name])


def test_darkbloom_worked_rows():
    # Qwen3.6 full-attention geometry: 2 KV heads x 256, int4 row = 128 + 16 + 16 bytes.
    assert KVFormat("int4", 256).k_row_bytes() == 160
    assert 10 * KVFormat("int4", 256, "bfloat16").bytes_per_token(2) == 6400
    assert 12 * KVFormat("int4", 64).bytes_per_token(8) == 7680


@pytest.mark.parametrize("head_dim,block", [(64, 64), (128, 128), (256, 128), (512, 128)])
@pytest.mark.parametrize("name", ["int8", "k8v4", "int4"])
def test_identity_round_trips_through_the_grammar(name, head_dim, block):
    fmt = KVFormat(name, head_dim)
    assert fmt.identity.endswith(f"-h{block}-s1")
    parsed = parse_identity(fmt.identity)
    assert (parsed["name"], parsed["rotation_block"]) == (name, block)
    assert format_from_identity(fmt.identity, head_dim) == fmt


@pytest.mark.parametrize("bad", [
    "", "int4", "affine-v2-k4v4-g64-f32-h128-s1", "affine-v1-k4v8-g64-f32-h128-s1",
    "affine-v1-k4v4-g32-f32-h128-s1", "affine-v1-k4v4-g64-f16-h128-s1",
    "affine-v1-k4v4-g64-f32-h128-s2", "affine-v1-k4v4-g64-f32-h128-s1 ",
    "AFFINE-v1-k4v4-g64-f32-h128-s1", "native-v1-fp8", "x" * 200, None, 7])
def test_grammar_rejects_everything_else(bad):
    with pytest.raises(KVFormatError):
        parse_identity(bad)


def test_identity_must_fit_the_head_dim():
    with pytest.raises(KVFormatError):
        format_from_identity(KVFormat("int4", 64).identity, head_dim=128)
    assert format_from_identity("native-v1-bf16", 128) == KVFormat("native", 128, "bfloat16")


def test_native_and_packed_identities_never_alias():
    ids = {KVFormat(n, 128, d).identity for n in ("native", "int8", "k8v4", "int4")
           for d in ("float32", "bfloat16")}
    assert len(ids) == 5  # packed identities do not depend on the compute dtype; native ones do


@pytest.mark.parametrize("raw,name", [(" INT4 ", "int4"), ("K8V4", "k8v4"), ("native\n", "native")])
def test_names_are_trimmed_and_lower_cased(raw, name):
    assert normalize_format_name(raw) == name


def test_policy_override_is_exact_model_id():
    overrides = {"org/model-a": " Int8 ", "org/model-b": "k8v4"}
    assert resolve_kv_format("org/model-a", "native", overrides) == "int8"
    assert resolve_kv_format("org/model-b", "int4", overrides) == "k8v4"
    # No prefix, suffix or case matching: a sibling checkpoint gets the default.
    assert resolve_kv_format("org/model-a-4bit", "native", overrides) == "native"
    assert resolve_kv_format("ORG/MODEL-A", " INT4", overrides) == "int4"


def test_weight_quantization_never_selects_kv_precision():
    # A 4-bit/8-bit weight artifact still gets the configured default, native unless told.
    for model_id in ("mlx-community/Qwen3-4B-4bit", "mlx-community/Llama-3-8B-8bit", "x-int4"):
        assert resolve_kv_format(model_id) == "native"
        assert resolve_kv_format(model_id, "int8", {}) == "int8"


@pytest.mark.parametrize("default,overrides", [
    ("int3", {}), ("native", {"m": "fp8"}), ("", {}), ("native", {"m": ""}), ("native", {"m": None})])
def test_unknown_values_refuse_the_load(default, overrides):
    with pytest.raises(KVFormatError, match="refusing to load|unknown|must be"):
        resolve_kv_format("m", default, overrides)
    with pytest.raises(KVFormatError):
        validate_policy(default, overrides)


def test_validate_policy_checks_overrides_of_other_models_too():
    validate_policy("native", {"a": "INT4", "b": " k8v4"})
    with pytest.raises(KVFormatError, match="'b'"):
        validate_policy("native", {"a": "int4", "b": "int2"})


def test_only_full_attention_layers_are_packed():
    fmt = KVFormat("int4", 64, "bfloat16")
    assert layer_format(fmt, "full") == fmt
    for kind in ("sliding", "rotating", "recurrent"):
        assert layer_format(fmt, kind) == KVFormat("native", 64, "bfloat16")
    with pytest.raises(KVFormatError):
        layer_format(fmt, "cross")


def test_packed_formats_need_group_aligned_head_dims():
    with pytest.raises(KVFormatError):
        KVFormat("int8", 96)
    assert KVFormat("native", 96).bytes_per_token(1) == 2 * 96 * 4
