"""An Orchard app served in this process over real HTTP (uvicorn on a free port, no Ray), for
the OpenAI-surface tests (tests/test_api_*.py): the full ingress and the real engine, started in
seconds instead of a Serve deployment."""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "models" / "orchard-tiny")


@contextlib.contextmanager
def served(models: list[dict], **config):
    """Yield the base URL of an app serving `models` (config `models` entries)."""
    import uvicorn

    from serve_app.app import build_local_app
    from serve_app.config import parse_config
    from tests.fixtures.serve import free_port, wait_for

    app, servers = build_local_app(parse_config({"models": models, **config}))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 60, "uvicorn to start")
        assert server.started, "uvicorn failed to start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        for s in servers.values():
            s.shutdown()


def tiny_with_template(folder: Path, template) -> str:
    """orchard-tiny's weights (symlinked) behind another chat template: `template(old)` returns
    the new Jinja text. For real template behaviour (strict roles, tool formats) on tiny weights."""
    import json
    import os

    for name in os.listdir(TINY):
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(TINY, name), folder / name)
    cfg = json.load(open(os.path.join(TINY, "tokenizer_config.json")))
    cfg["chat_template"] = template(cfg["chat_template"])
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(folder)

