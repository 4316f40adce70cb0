"""Config: defaults, per-model KV resolution, and fail-fast messages that name the field."""
from pathlib import Path

import pytest

from serve_app.config import ConfigError, OrchardConfig, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def test_minimal_config_gets_defaults():
    cfg = parse_config({"models": [{"id": "m", "path": "/x"}]})
    m = cfg.models[0]
    assert (m.replicas, m.max_num_seqs, m.resources.num_cpus) == (1, 32, 0.5)
    assert cfg.http.port == 8000 and cfg.capacity.namespace == "orchard"
    assert cfg.kv_format_for(m) == "native"


def test_queue_and_serve_defaults():
    cfg = parse_config({"models": [{"id": "m", "path": "/x"}]})
    assert (cfg.capacity.queue_timeout_s, cfg.capacity.max_queued) == (120.0, 1024)
    assert cfg.http.direct_ingress
    assert cfg.replica_env_vars()["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    # replica_env wins over the fast-path defaults; hold_wait_s is the queue timeout's old name.
    cfg = parse_config({"models": [{"id": "m", "path": "/x"}], "capacity": {"hold_wait_s": 5},
                        "replica_env": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}})
    assert cfg.capacity.queue_timeout_s == 5.0
    assert cfg.replica_env_vars()["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"
    assert cfg.capacity.actor_config() is None
    assert parse_config({"models": [{"id": "m", "path": "/x"}],
                         "capacity": {"decode_floor_tps": 5}}).capacity.actor_config() == {
        "caps": {"floor_tps": 5.0}}
    # What the ingress and routers receive round-trips through the schema.
    assert OrchardConfig.model_validate(cfg.model_dump()).capacity.queue_timeout_s == 5.0


def test_direct_ingress_env_pins_the_public_port():
    from serve_app.launch import direct_ingress_env

    env = direct_ingress_env(8000)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve's port range is [min, max): exactly the configured port.
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
            env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8000", "8001")


def test_kv_format_precedence_model_then_override_then_default():
    cfg = parse_config({
        "kv": {"default": "int8", "overrides": {"b": "k8v4"}},
        "models": [{"id": "a", "path": "/a", "kv_format": "INT4"},
                   {"id": "b", "path": "/b"}, {"id": "c", "path": "/c"}]})
    assert [cfg.kv_format_for(m) for m in cfg.models] == ["int4", "k8v4", "int8"]


@pytest.mark.parametrize("data, field", [
    ({"models": [{"id": "m", "path": "/x", "kv_format": "int3"}]}, "models.0.kv_format"),
    ({"models": [{"id": "m", "path": "/x", "replicas": 0}]}, "models.0.replicas"),
    ({"models": [{"id": "m", "path": "/x", "replcas": 2}]}, "models.0.replcas"),
    ({"models": []}, "models"),
    ({"models": [{"id": "m", "path": "/x"}], "http": {"port": 70000}}, "http.port"),
    ({"models": [{"id": "m", "path": "/x"}, {"id": "m", "path": "/y"}]}, "models.1.id"),
    ({"models": [{"id": "m", "path": "/x"}], "kv": {"overrides": {"zz": "int8"}}}, "kv.overrides"),
    ({"models": [{"id": "a#b", "path": "/x"}]}, "models.0.id"),
    ({"models": [{"id": "m", "path": "/x"}], "kv": {"overrides": {"m": "int3"}}}, "kv.overrides"),
    ({"models": [{"id": "m", "path": "/x"}], "kv": {"default": "fp8"}}, "kv.default"),
    ({"models": [{"id": "m", "path": "/x", "engine": {"kv_format": "int8"}}]}, "models.0.engine"),
    ({"models": [{"id": "m", "path": "/x", "engine": {"max_step_tokn": 8}}]}, "models.0.engine"),
    ({"models": [{"id": "m", "path": "/x"}], "capacity": {"queue_timeout_s": -1}},
     "capacity.queue_timeout_s"),
    ({"models": [{"id": "m", "path": "/x"}], "capacity": {"max_queued": -1}},
     "capacity.max_queued"),
    ({"models": [{"id": "m", "path": "/x"}], "capacity": {"decode_floor_tps": 0}},
     "capacity.decode_floor_tps"),
])
def test_invalid_config_names_the_field(data, field):
    with pytest.raises(ConfigError) as e:
        parse_config(data, source="c.yaml")
    assert f"c.yaml: {field}" in str(e.value) or f"{field}:" in str(e.value), str(e.value)


def test_load_config_resolves_relative_model_path(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "c.yaml").write_text("models:\n  - id: m\n    path: weights\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.models[0].path == str((tmp_path / "weights").resolve())


def test_bad_yaml_and_missing_file_fail_with_path(tmp_path):
    (tmp_path / "bad.yaml").write_text("models: [\n")
    with pytest.raises(ConfigError, match="bad.yaml: invalid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_example_config_is_valid():
    cfg = load_config(REPO / "config.example.yaml")
    assert isinstance(cfg, OrchardConfig) and cfg.models


def test_api_keys_from_env(monkeypatch):
    monkeypatch.setenv("ORCHARD_API_KEYS", "k1, k2")
    cfg = parse_config({"models": [{"id": "m", "path": "/x"}], "api_keys": ["k0"]})
    assert cfg.all_api_keys() == ["k0", "k1", "k2"]


def test_bench_only_prefill_mode_is_refused_in_a_serving_config():
    for mode in ("fused", "direct"):
        with pytest.raises(ConfigError, match=r"engine\.prefill_mode cannot be set in a serving "
                                              r"config.*benchmarks only"):
            parse_config({"models": [{"id": "m", "path": "/x",
                                      "engine": {"prefill_mode": mode}}]})


def test_bench_only_compiled_decode_is_refused_in_a_serving_config():
    # Rates are learned per execution identity, which does not name the decode path: a served
    # replica always runs the production one.
    for value in (True, False):
        with pytest.raises(ConfigError, match=r"engine\.compiled_decode cannot be set in a "
                                              r"serving config.*benchmarks only"):
            parse_config({"models": [{"id": "m", "path": "/x",
                                      "engine": {"compiled_decode": value}}]})


def test_bench_only_prefill_attention_is_refused_in_a_serving_config():
    # The same rule: the identity does not name how prefill attends.
    for value in ("auto", "fast", "ops"):
        with pytest.raises(ConfigError, match=r"engine\.prefill_attention cannot be set in a "
                                              r"serving config.*benchmarks only"):
            parse_config({"models": [{"id": "m", "path": "/x",
                                      "engine": {"prefill_attention": value}}]})
