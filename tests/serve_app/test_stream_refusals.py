"""Engine finishes that come before any token become HTTP errors at the ingress
(serve_app/streaming.py, open_stream): "memory" (the replica's KV pool could not grow) is a 503
kv_memory_unavailable with Retry-After; "deadline" a 503 deadline_exceeded. The backend here
is a stand-in that streams one engine Delta, as a replica would."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.request import Delta, Usage
from serve_app.errors import APIError
from serve_app.streaming import open_stream
from serve_app.wire import ReplicaDelta


def _entry(finish_reason, tokens=()):
    async def stream(call):
        yield ReplicaDelta(Delta("r", "", list(tokens), finish_reason, Usage(5, len(tokens))))

    return SimpleNamespace(backend=SimpleNamespace(stream=stream))


@pytest.mark.parametrize("reason,code", [("memory", "kv_memory_unavailable"),
                                         ("deadline", "deadline_exceeded")])
def test_a_finish_before_any_token_is_a_503_with_retry_after(reason, code):
    with pytest.raises(APIError) as err:
        asyncio.run(open_stream(SimpleNamespace(caller="test"), _entry(reason)))
    assert err.value.status == 503 and err.value.code == code
    assert err.value.retry_after_s > 0


def test_a_stream_with_tokens_opens():
    first, rest = asyncio.run(open_stream(SimpleNamespace(caller="test"), _entry("length", [7])))
    assert first.delta.token_ids == [7]
