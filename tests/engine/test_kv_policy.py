"""KV format policy through the Engine: exact-model overrides, refusals, and what stats report."""
import pytest
from pydantic import ValidationError

from capacity.formats import KVFormatError
from engine.config import EngineConfig
from engine import Engine
from tests.engine_helpers import PAGE_BYTES_LLAMA, collect, make_engine, req, run, tokens


def test_override_map_is_validated_and_normalized():
    cfg = EngineConfig(model="m", kv_format_overrides={"m": " INT4 ", "other": "k8v4"})
    assert cfg.kv_format_overrides == {"m": "int4", "other": "k8v4"}
    with pytest.raises(ValidationError, match="override for model 'm'.*'int3'"):
        EngineConfig(model="m", kv_format_overrides={"m": "int3"})
    with pytest.raises(ValidationError, match="prefill_mode"):
        EngineConfig(model="m", prefill_mode="tiled")


def test_unknown_format_refuses_the_load_instead_of_falling_back(tiny_llama):
    # A config built without validation (e.g. by a caller bypassing pydantic) still cannot load.
    cfg = EngineConfig.model_construct(**{**EngineConfig(model=tiny_llama).model_dump(),
                                          "kv_format_overrides": {tiny_llama: "fp8"}})
    with pytest.raises(KVFormatError, match="refusing to load.*override.*'fp8'"):
        Engine(cfg)


def test_exact_model_override_selects_the_format_and_stats_report_it(tiny_llama):
    eng = make_engine(tiny_llama, pages=16, kv_format="native",
                      kv_format_overrides={tiny_llama: "int4", tiny_llama + "-sibling": "int8"})
    try:
        s = eng.stats()
        assert s.kv_format == "int4" and s.prefill_mode == "direct"
        assert eng.format_identity == "affine-v1-k4v4-g64-f32-h64-s1"
        assert s.storage_identity == ("0=affine-v1-k4v4-g64-f32-h64-s1;"
                                         "1=affine-v1-k4v4-g64-f32-h64-s1")
        # Per layer: int4 rows of 2 KV heads x (32 code bytes + 8 metadata) for K and V.
        assert s.kv_layers == [{"layer": i, "storage": "affine-v1-k4v4-g64-f32-h64-s1",
                                   "bytes_per_token": 2 * 2 * 40} for i in (0, 1)]
        assert s.kv_path_counters == dict(direct=0, fused=0, budget_fallback=0,
                                             ineligible_fallback=0)
        run(collect(eng, req("a", n_prompt=40, max_tokens=3, ignore_eos=True)))
        c = eng.stats().kv_path_counters
        assert c["direct"] > 0 and c["fused"] == 0   # direct mode never takes the fused path
    finally:
        eng.shutdown()


def test_native_engine_reports_native_layers(tiny_llama):
    eng = make_engine(tiny_llama, pages=4, kv_format_overrides={"someone-else": "int4"})
    try:
        s = eng.stats()
        assert s.kv_format == "native" and s.format_identity == "native-v1-f32"
        assert [r["bytes_per_token"] * 16 for r in s.kv_layers] == [PAGE_BYTES_LLAMA // 2] * 2
        assert tokens(run(collect(eng, req("n", max_tokens=2, ignore_eos=True))))
    finally:
        eng.shutdown()
