"""`--model` on the benchmark, quality and load-test commands (engine.model.names): short names
resolve to their folders under models/, a missing real model says to run `make real-model`, an
unknown name lists the known ones, a .gguf file goes through the one-time import cache, and each
command's --help and parser use the one shared resolver. Nothing is benchmarked; no Ray."""
from __future__ import annotations

import json

import pytest

from engine.model import names as model_names
from engine.model.names import ModelNameError, resolve_model, served_id


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """An empty models/ folder standing in for the repository's."""
    root = tmp_path / "models"
    root.mkdir()
    monkeypatch.setattr(model_names, "MODELS_DIR", root)
    return root


def _fake_model(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def test_smollm2_resolves_to_the_imported_folder(models_dir):
    folder = _fake_model(models_dir / "smollm2-135m")
    assert resolve_model("smollm2") == str(folder)
    assert resolve_model("smollm2-135m") == str(folder)   # the served id is an alias


def test_missing_real_model_says_make_real_model(models_dir):
    with pytest.raises(ModelNameError, match="make real-model"):
        resolve_model("smollm2")
    (models_dir / "smollm2-135m").mkdir()   # an interrupted import: no config.json
    with pytest.raises(ModelNameError, match="make real-model"):
        resolve_model("smollm2")


def test_orchard_tiny_is_the_embedded_folder():
    path = resolve_model("orchard-tiny")
    assert path == str(model_names.REPO_ROOT / "models" / "orchard-tiny")


def test_bad_name_lists_the_known_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNameError) as e:
        resolve_model("smollm3")
    assert "orchard-tiny" in str(e.value) and "smollm2" in str(e.value)


def test_paths_folders_and_refusals(tmp_path):
    folder = _fake_model(tmp_path / "my-model")
    assert resolve_model(str(folder)) == str(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNameError, match="not a model folder"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNameError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNameError, match="no such folder or .gguf file"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_gguf_file_is_imported_once_through_the_cache(tmp_path, monkeypatch, capfd):
    from tests.fixtures.gguf_models import build_gguf_pair

    monkeypatch.setenv("ORCHARD_GGUF_CACHE", str(tmp_path / "cache"))
    src = build_gguf_pair("llama", "Q8_0", tmp_path / "src")["gguf"]
    folder = resolve_model(str(src))
    assert folder.startswith(str(tmp_path / "cache")) and (
        tmp_path / "cache" / folder.rsplit("/", 1)[-1] / "config.json").is_file()
    assert "imported" in capfd.readouterr().err
    assert resolve_model(str(src)) == folder
    assert "imported" not in capfd.readouterr().err


def test_served_id_maps_short_names_and_keeps_ids_and_paths(tmp_path):
    assert served_id("smollm2") == "smollm2-135m"      # what `make serve` serves it as
    assert served_id("smollm2-135m") == "smollm2-135m"
    assert served_id("orchard-tiny") == "orchard-tiny"
    assert served_id("bench-native") == "bench-native"  # an id of some config: sent as given
    folder = str(_fake_model(tmp_path / "my-model"))
    assert served_id(folder) == folder                  # mlx_lm.server's id is its model path


def test_orchard_bench_engine_help_mentions_smollm2(capsys):
    from serve_app.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "engine", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--model" in out and "smollm2" in out and "make real-model" in out


def test_every_model_taking_command_explains_and_resolves_the_flag(capsys):
    from bench import kv as bench_kv
    from quality import gate as quality
    from loadtest import bench_serve, runner
    from bench import serve_path as serve_bench

    for main in (bench_kv.main, serve_bench.main, lambda a: quality.build_parser().parse_args(a),
                 lambda a: runner.parser().parse_args(a),
                 lambda a: bench_serve.parser().parse_args(a)):
        with pytest.raises(SystemExit):
            main(["--help"])
        assert "smollm2" in capsys.readouterr().out
    tiny = str(model_names.REPO_ROOT / "models" / "orchard-tiny")
    assert quality.build_parser().parse_args([]).model == tiny    # the default stays orchard-tiny
    assert quality.build_parser().parse_args(["--model", "orchard-tiny"]).model == tiny
    assert runner.parser().parse_args(["--host", "http://h", "--model", "smollm2"]).model == \
        "smollm2-135m"
    args = bench_serve.parser().parse_args(["--target", "url=http://h,model=smollm2",
                                            "--peer-model", "orchard-tiny"])
    assert args.target[0].model == "smollm2-135m" and args.peer_model == tiny


def test_cli_usage_errors_name_the_fix(models_dir, capsys):
    from serve_app.cli import main

    for argv in (["bench", "engine", "--model", "smollm2"], ["bench", "kv", "--model", "smollm2"],
                 ["quality", "--model", "smollm2"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --model" in err and "make real-model" in err
    with pytest.raises(SystemExit) as e:
        main(["bench", "engine", "--model", "no-such-model"])
    assert e.value.code == 2 and "orchard-tiny, smollm2" in capsys.readouterr().err
    # serve resolves MODEL before Ray starts: exit 2 naming the fix (positional or --model).
    for argv in (["serve", "--model", "smollm2"], ["serve", "smollm2"]):
        assert main(argv) == 2 and "make real-model" in capsys.readouterr().err
