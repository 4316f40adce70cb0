"""The mlx_lm.server peer: the model copy it is given (conversion is cached, hub ids pass)."""
from __future__ import annotations


def test_peer_model_conversion_is_cached(tmp_path, monkeypatch):
    import subprocess

    from loadtest import peer

    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text("{}")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = cmd[cmd.index("--mlx-path") + 1]
        import os
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "config.json"), "w").write("{}")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    assert peer.prepare_model(str(src), "as-is") == str(src)
    a = peer.prepare_model(str(src), "float32")
    b = peer.prepare_model(str(src), "float32")
    assert a == b and "-float32-" in a and len(calls) == 1
    assert calls[0][calls[0].index("--dtype") + 1] == "float32"
    assert peer.prepare_model("org/hub-id", "float32") == "org/hub-id"
