"""The real model through the HTTP layer: greedy /v1/completions text equals mlx-lm's greedy
continuation of the same prompt on the imported SmolLM2 folder (token for token; mlx-lm's text
is decoded whole, so its first token keeps its leading space as ours does)."""
import asyncio

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "import numpy as np\n\nx = np."]


@pytest.mark.real
def test_greedy_http_completions_equal_mlx_lm_on_smollm2():
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    from engine.model.gguf.real_model import ensure_real_model
    from serve_app.app import build_local_app
    from serve_app.config import parse_config

    folder = ensure_real_model()
    model, tok = load(str(folder))
    want = []
    for p in PROMPTS:
        ids = [r.token for r in stream_generate(model, tok, p, max_tokens=24,
                                                sampler=make_sampler(0.0))]
        want.append(tok.decode([t for t in ids if t not in tok.eos_token_ids]))
    del model
    app, servers = build_local_app(parse_config({"models": [
        {"id": "smollm2", "path": str(folder), "max_num_seqs": 4}]}))

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://orchard", timeout=300) as c:
            out = []
            for p in PROMPTS:
                r = await c.post("/v1/completions", json={
                    "model": "smollm2", "prompt": p, "max_tokens": 24, "temperature": 0})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["text"])
            return out
    try:
        got = asyncio.run(ask())
    finally:
        for s in servers.values():
            s.shutdown()
    assert got == want
    assert got[0].startswith(" Paris")
