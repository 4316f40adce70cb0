"""Graceful drain, in one process (the same ModelServer a replica runs; Serve calls its
shutdown from __del__): running requests finish, new ones get 503 with Retry-After."""
import asyncio

import httpx

from serve_app.app import build_local_app
from serve_app.config import parse_config


def test_drain_finishes_running_requests_and_refuses_new_ones(tiny_llama):
    app, servers = build_local_app(parse_config({"models": [{"id": "m", "path": tiny_llama}]}))
    [server] = servers.values()
    body = {"model": "m", "max_tokens": 120, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "drain me"}]}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://orchard", timeout=120) as c:
            running = asyncio.create_task(c.post("/v1/chat/completions", json=body))
            while server.engine.stats().num_requests_running == 0:
                await asyncio.sleep(0.01)
            drain = asyncio.create_task(asyncio.to_thread(server.shutdown))
            while server.engine.healthy():
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            await drain
            return await running, refused

    finished, refused = asyncio.run(scenario())
    assert finished.status_code == 200
    assert finished.json()["usage"]["completion_tokens"] == 120
    assert finished.json()["choices"][0]["finish_reason"] == "length"
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "shutting_down"
