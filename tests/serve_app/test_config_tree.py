"""One typed config tree: a model's `engine:` is an EngineConfig, each served default is declared
once, the capacity actor's sections refuse unknown keys, and a misspelt key in a YAML fails
`orchard serve` at load with a message naming it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capacity.caps import CapConfig
from capacity.fleet import FleetConfig
from engine.config import EngineConfig
from serve_app.config import (BENCH_ONLY_ENGINE_KNOBS, SERVE_OWNED_ENGINE_KNOBS,
                              SERVED_ENGINE_DEFAULTS, CapacitySettings, ConfigError,
                              OrchardConfig, load_config, parse_config)

REPO = Path(__file__).resolve().parents[2]


def test_engine_section_is_an_engine_config_over_the_served_defaults():
    cfg = parse_config({"models": [{"id": "m", "path": "/x"},
                                   {"id": "n", "path": "/y", "max_num_seqs": 8,
                                    "engine": {"max_step_tokens": 256,
                                               "enable_prefix_caching": False}}]})
    m, n = cfg.models
    assert isinstance(m.engine, EngineConfig) and m.engine.enable_prefix_caching
    e = m.engine_config("int8")
    assert (e.model, e.kv_format, e.max_num_seqs, e.enable_prefix_caching) == ("/x", "int8", 32,
                                                                                True)
    assert e.max_step_tokens == EngineConfig.model_fields["max_step_tokens"].default
    f = n.model_copy(update={"kv_budget_bytes": 1 << 30}).engine_config("native")
    assert (f.max_num_seqs, f.max_step_tokens, f.enable_prefix_caching, f.kv_budget_bytes) == (
        8, 256, False, 1 << 30)
    # A dumped config validates again to the same tree (the ingress and routers receive one).
    again = OrchardConfig.model_validate(cfg.model_dump())
    assert [x.engine_config("native") for x in again.models] == [
        x.engine_config("native") for x in cfg.models]


def test_knob_lists_name_real_engine_fields():
    fields = set(EngineConfig.model_fields)
    assert SERVE_OWNED_ENGINE_KNOBS <= fields and set(BENCH_ONLY_ENGINE_KNOBS) <= fields
    assert set(SERVED_ENGINE_DEFAULTS) <= fields - SERVE_OWNED_ENGINE_KNOBS


def test_capacity_defaults_come_from_the_actor_and_land_in_its_fields():
    caps = CapConfig()
    s = CapacitySettings()
    assert (s.max_slowdown, s.ttft_objective_s) == (caps.max_slowdown, caps.ttft_objective_s)
    got = FleetConfig.from_dict(CapacitySettings(decode_floor_tps=9, max_slowdown=3,
                                                 ttft_objective_s=None).actor_config()).caps
    assert (got.floor_tps, got.max_slowdown, got.ttft_objective_s) == (9.0, 3.0, None)


@pytest.mark.parametrize("yaml_text, key", [
    ("models:\n  - id: m\n    path: /x\n    engine: {max_step_tokenz: 8}\n",
     "models.0.engine: unknown engine knob(s) max_step_tokenz"),
    ("models:\n  - id: m\n    path: /x\ncapacity: {decode_floor_tp: 9}\n",
     "capacity.decode_floor_tp"),
    ("models:\n  - id: m\n    path: /x\n    max_num_seq: 8\n", "models.0.max_num_seq"),
])
def test_misspelt_key_fails_at_load_naming_it(tmp_path, yaml_text, key):
    path = tmp_path / "typo.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
        load_config(path)


def test_misspelt_key_fails_orchard_serve_before_ray(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("models:\n  - id: m\n    path: /nowhere\n    engine: {max_step_tokenz: 8}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "serve_app.cli", "serve", str(path)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "models.0.engine" in r.stderr and "max_step_tokenz" in r.stderr
    assert "starting a local Ray" not in r.stdout
