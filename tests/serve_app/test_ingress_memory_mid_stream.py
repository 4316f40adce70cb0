"""A request the engine finishes with reason "memory" after its first token (its replica's KV pool
could not grow for its next page: tests/engine/kv/test_pool_growth_midstep.py) fails at the
ingress (serve_app/streaming.py, choice_deltas): a stream ends with the kv_memory_unavailable
error event and [DONE] after the tokens it had, a plain request answers 503 + Retry-After, not a
reply cut short as if it were complete. The backend is a stand-in that streams engine Deltas as
a replica would; the engine side is tested on a real engine."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from engine.request import Delta, Usage
from serve_app import protocol as P
from serve_app.errors import APIError, from_exception
from serve_app.metrics import Metrics
from serve_app.streaming import Choices, Tracker, merge, open_streams, sse
from serve_app.wire import ReplicaDelta


def _entry(*finishes):
    """Each call streams "tok " twice, then a final delta with the next finish reason (and,
    when `coalesced`, that delta also carries a token, as a replica's coalesced delta may)."""
    left = list(finishes)

    async def stream(call):
        reason, coalesced = left.pop(0)
        yield ReplicaDelta(Delta("r", "tok ", [7], None, Usage(5, 1)))
        yield ReplicaDelta(Delta("r", "tok ", [8], None, Usage(5, 2)))
        yield ReplicaDelta(Delta("r", "end" if coalesced else "", [9] if coalesced else [],
                                 reason, Usage(5, 3 if coalesced else 2)))

    return SimpleNamespace(backend=SimpleNamespace(stream=stream), prefix_caching=False)


def _calls(n):
    return [SimpleNamespace(caller="test") for _ in range(n)]


def _choices(n):
    return Choices("chat", P.ResponseBuilder("chat", "r", "m"), None, "", n)


async def _sse(entry, n):
    streams = await open_streams(_calls(n), entry)
    tracker = Tracker(Metrics(), "m", "native", 0.0)
    failed = lambda rid, model, e: from_exception(e)  # noqa: E731 - the ingress's, uncounted
    return [c async for c in sse(_choices(n), streams, P.UsageStats.NONE, tracker, failed)]


def _choice_chunks(chunks):
    return [ch for c in chunks for ch in json.loads(c.removeprefix("data: ")).get("choices", [])]


def _content(chunks):
    return "".join(ch["delta"].get("content") or "" for ch in _choice_chunks(chunks))


def _finishes(chunks):
    return [ch["finish_reason"] for ch in _choice_chunks(chunks) if ch["finish_reason"]]


@pytest.mark.parametrize("coalesced", [False, True])
def test_a_stream_finished_for_memory_ends_with_the_error_event_after_its_tokens(coalesced):
    chunks = asyncio.run(_sse(_entry(("memory", coalesced)), 1))
    assert chunks[-1] == P.SSE_DONE
    err = json.loads(chunks[-2].removeprefix("data: "))["error"]
    assert err["code"] == "kv_memory_unavailable" and err["type"] == "service_unavailable"
    text = _content(chunks[:-2])
    assert text == ("tok tok end" if coalesced else "tok tok ")
    # Nothing told the client the reply was complete.
    assert _finishes(chunks[:-2]) == []


def test_one_choice_finished_for_memory_fails_the_whole_stream():
    chunks = asyncio.run(_sse(_entry(("length", False), ("memory", False)), 2))
    assert chunks[-1] == P.SSE_DONE
    assert _finishes(chunks[:-2]) in ([], ["length"])   # the other choice may have ended first
    assert json.loads(chunks[-2].removeprefix("data: "))["error"]["code"] == \
        "kv_memory_unavailable"


def test_a_plain_request_finished_for_memory_is_a_503_with_retry_after():
    async def plain():
        merged = merge(await open_streams(_calls(1), _entry(("memory", False))))
        try:
            return [item async for item in merged]
        finally:
            await merged.aclose()

    with pytest.raises(APIError) as err:
        asyncio.run(plain())
    assert err.value.status == 503 and err.value.code == "kv_memory_unavailable"
    assert err.value.retry_after_s > 0


def test_other_finishes_still_end_normally():
    chunks = asyncio.run(_sse(_entry(("length", False)), 1))
    assert chunks[-1] == P.SSE_DONE
    assert _finishes(chunks[:-1]) == ["length"]
    assert _content(chunks[:-1]) == "tok tok "
