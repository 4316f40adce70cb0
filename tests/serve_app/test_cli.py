"""`orchard` CLI without a cluster: help for every command, and config errors that name the
field and exit 2 before Ray starts."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def orchard(*args, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "serve_app.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("args, expect", [
    ((), "serve"), (("serve",), "CONFIG"), (("deploy",), "--address"), (("status",), "--app"),
    (("loadtest",), "--scenario"), (("bench",), "serve-path"), (("bench", "capacity"), "--callers"),
    (("bench", "kv"), "usage"), (("bench", "serve"), "usage"), (("bench", "engine"), "usage"),
    (("quality",), "--retrieval-cases")])
def test_help(args, expect):
    r = orchard(*args, "--help")
    assert r.returncode == 0 and expect in r.stdout


def test_unknown_benchmark_is_refused():
    r = orchard("bench", "nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_invalid_config_fails_fast_naming_the_field(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("models:\n  - id: m\n    path: /nowhere\n    kv_format: int3\n")
    r = orchard("serve", str(cfg))
    assert r.returncode == 2
    assert "models.0.kv_format" in r.stderr and "int3" in r.stderr
    assert "starting a local Ray" not in r.stdout


def test_missing_default_model_is_named(monkeypatch, tmp_path):
    # The shipped model exists in this checkout; point the default elsewhere to see the message.
    import serve_app.config as config

    monkeypatch.setattr(config, "DEFAULT_MODEL_DIR", tmp_path / "orchard-tiny")
    with pytest.raises(config.ConfigError, match="default model missing: .*orchard-tiny"):
        config.default_config()
