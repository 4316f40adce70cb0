"""`orchard serve MODEL [--kv-format F]`: one model with no YAML. MODEL is a short name, a folder,
a .gguf file or a Hugging Face id resolved through the local cache only (never the network).

The hub cache here is a real folder laid out as huggingface_hub lays it out (blobs, a snapshot of
symlinks, refs/main), holding orchard-tiny's real files; HF_HUB_CACHE points at it. Resolution and
bad input run in-process or through the real CLI (bad input exits 2 before Ray starts); one test
serves the cached hub id end to end with a local Ray of its own.
"""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from engine.platform import openblas_env
from serve_app.cli import _parser
from serve_app.commands import serve_config
from serve_app.config import ConfigError
from tests.fixtures.serve import free_port, wait_cli_ready

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "orchard-tiny"
HUB_ID = "orchard-test/orchard-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(root: Path, repo_id: str = HUB_ID, src: Path = TINY) -> Path:
    """A Hugging Face cache with `src`'s files as repo `repo_id` at COMMIT; returns the snapshot
    folder. Layout as huggingface_hub writes it: blobs/<sha256>, snapshots/<commit>/<name> ->
    ../../blobs/<sha256>, refs/main = commit."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in sorted(src.iterdir()):
        if not f.is_file():
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    snap = make_hub_cache(cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once at import; its default is looked up per call.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache, snap


def config_for(*argv: str):
    return serve_config(_parser().parse_args(["serve", *argv]))


def test_hub_id_resolves_to_the_cached_snapshot_once(hub_cache):
    _, snap = hub_cache
    cfg = config_for(HUB_ID, "--kv-format", "INT8")
    [m] = cfg.models
    assert m.id == "orchard-tiny"                   # ids may not contain '/'
    assert Path(m.path) == snap.resolve()           # the folder both engine and ingress load
    assert cfg.kv_format_for(m) == "int8"
    assert (Path(m.path) / "tokenizer.json").is_file()


def test_hub_id_loads_in_the_engine_and_the_ingress_tokenizer(hub_cache):
    """The snapshot of symlinks is a loadable model: the engine's loader and the tokenizer the
    ingress builds both read it."""
    from engine.model.loader import load_model
    from transformers import AutoTokenizer

    [m] = config_for(HUB_ID).models
    loaded = load_model(m.path, dtype="float32", allow_hub=False)
    assert loaded is not None
    tok = AutoTokenizer.from_pretrained(m.path)
    assert tok.encode("hello") == AutoTokenizer.from_pretrained(str(TINY)).encode("hello")


def test_model_flag_is_an_alias_and_short_names_keep_their_ids(hub_cache):
    assert config_for("--model", HUB_ID).models[0].path == config_for(HUB_ID).models[0].path
    [m] = config_for("orchard-tiny").models
    assert m.id == "orchard-tiny" and Path(m.path) == TINY
    assert config_for(str(TINY), "--model-id", "t").models[0].id == "t"
    with pytest.raises(ConfigError, match="not both"):
        config_for(HUB_ID, "--model", "orchard-tiny")


def test_yaml_is_still_a_config(tmp_path):
    cfg_file = tmp_path / "c.yml"
    cfg_file.write_text(f"models:\n  - id: mine\n    path: {TINY}\n    kv_format: k8v4\n")
    cfg = config_for(str(cfg_file))
    assert [m.id for m in cfg.models] == ["mine"] and cfg.kv_format_for(cfg.models[0]) == "k8v4"
    with pytest.raises(ConfigError, match="--kv-format and --model-id apply to one MODEL"):
        config_for(str(cfg_file), "--kv-format", "int8")


def orchard(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "serve_app.cli", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=120)


def test_hub_id_not_in_cache_says_how_to_fetch_it_and_starts_nothing(tmp_path):
    r = orchard("serve", "someone/not-cached-model",
                env={"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr
    assert "someone/not-cached-model" in r.stderr and "not in the local cache" in r.stderr
    assert "hf download someone/not-cached-model" in r.stderr
    assert "starting a local Ray" not in r.stdout


def test_unknown_kv_format_is_refused_with_the_list():
    r = orchard("serve", "orchard-tiny", "--kv-format", "int3")
    assert r.returncode == 2
    assert "--kv-format" in r.stderr and "int3" in r.stderr
    assert all(f in r.stderr for f in ("native", "int8", "k8v4", "int4"))
    assert "starting a local Ray" not in r.stdout


@pytest.mark.ray
@pytest.mark.slow
def test_serve_a_cached_hub_id_end_to_end(tmp_path):
    """The real CLI: a hub id from the local cache, int8 KV, a local Ray of its own; the startup
    summary names the model, folder, format, budget in tokens, ceiling and URL; /health is 200
    (the ingress read the tokenizer from the same snapshot) and a chat completes."""
    cache = tmp_path / "hf-cache"
    snap = make_hub_cache(cache)
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="orc", dir="/tmp")   # short: Unix socket paths
    env = {**os.environ, **openblas_env(), "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp,
           "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serve_app.cli", "serve", HUB_ID,
                                 "--kv-format", "int8", "--port", str(port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_cli_ready(proc, log)
        text = log.read_text()
        summary = text[text.index("startup summary"):]
        print("\n" + summary)
        assert f"orchard-tiny  ({snap.resolve()})" in summary
        assert "KV format    int8" in summary
        budget = summary.split("KV budget    ", 1)[1].split(" tokens", 1)[0]
        assert int(budget.replace(",", "")) > 0, summary
        assert "ceiling 32 (max_num_seqs)" in summary
        assert f"http://127.0.0.1:{port}/v1" in summary
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=120) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/chat/completions", json={
                "model": "orchard-tiny", "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) in (0, 130), log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
