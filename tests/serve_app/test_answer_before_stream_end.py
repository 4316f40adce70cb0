"""A reply is complete when every choice's finishing delta has arrived: the ingress sends the
usage chunk and [DONE] (or the JSON body) then, not when the replica's stream ends one round
trip later (its generator settling the request, Ray reporting end-of-stream). The replica stream
is still read to its natural end afterwards, so the replica settles the request normally instead
of seeing a cancellation (serve_app/streaming.py: until_answered, drain, drain_soon).

The backend is a stand-in that streams engine Deltas as a replica would and then holds its
stream's end until the test releases it: a slow end-of-stream cannot be caused on demand with
a real replica. The `wait_for` limits only turn a regression (a hang) into a failure."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from engine.request import Delta, Usage
from serve_app import protocol as P
from serve_app.errors import from_exception
from serve_app.metrics import Metrics
from serve_app.streaming import (Choices, Tracker, drain_soon, merge, open_streams, sse,
                                 until_answered)
from serve_app.wire import ReplicaDelta

LIMIT_S = 60.0


class HeldEnd:
    """Per choice: two tokens, a finishing delta, then the stream's end once `release` is set.
    Records whether each stream ended naturally or was closed early."""

    def __init__(self, n: int):
        self.release = asyncio.Event()
        self.ended = [False] * n
        self.closed_early = [False] * n
        self.over = [asyncio.Event() for _ in range(n)]   # set when stream i ended either way
        self._next = 0

    async def stream(self, call):
        i, self._next = self._next, self._next + 1
        try:
            yield ReplicaDelta(Delta("r", "tok ", [7], None, Usage(5, 1)))
            yield ReplicaDelta(Delta("r", "end", [8], "length", Usage(5, 2)))
            await self.release.wait()
            self.ended[i] = True
        except (GeneratorExit, asyncio.CancelledError):
            self.closed_early[i] = True
            raise
        finally:
            self.over[i].set()

    def entry(self):
        return SimpleNamespace(backend=SimpleNamespace(stream=self.stream), prefix_caching=False)


def _calls(n):
    return [SimpleNamespace(caller="test") for _ in range(n)]


async def _sse_until_done(n: int, usage: P.UsageStats):
    held = HeldEnd(n)
    streams = await open_streams(_calls(n), held.entry())
    out = Choices("completions", P.ResponseBuilder("completions", "r", "m"), None, "", n)
    tracker = Tracker(Metrics(), "m", "native", 0.0)
    failed = lambda rid, model, e: from_exception(e)  # noqa: E731 - the ingress's, uncounted
    body = sse(out, streams, usage, tracker, failed)
    chunks = []
    async for chunk in body:
        chunks.append(chunk)
        if chunk == P.SSE_DONE:
            break
    ended_at_done = list(held.ended)
    held.release.set()
    async for chunk in body:   # the body generator drains the replica streams after [DONE]
        chunks.append(chunk)
    return chunks, ended_at_done, held


def test_done_goes_out_before_the_replica_stream_ends_and_the_stream_still_ends_naturally():
    chunks, ended_at_done, held = asyncio.run(asyncio.wait_for(
        _sse_until_done(1, P.UsageStats.FINAL), LIMIT_S))
    assert ended_at_done == [False]          # [DONE] did not wait for the stream's end
    assert chunks[-1] == P.SSE_DONE and chunks.count(P.SSE_DONE) == 1
    usage = json.loads(chunks[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 2   # the usage chunk is complete at [DONE]
    assert held.ended == [True] and held.closed_early == [False]


def test_with_two_choices_done_waits_for_both_finishes():
    chunks, ended_at_done, held = asyncio.run(asyncio.wait_for(
        _sse_until_done(2, P.UsageStats.NONE), LIMIT_S))
    finishes = [ch["finish_reason"] for c in chunks[:-1]
                for ch in json.loads(c.removeprefix("data: "))["choices"] if ch["finish_reason"]]
    assert finishes == ["length", "length"]
    assert ended_at_done == [False, False]
    assert held.ended == [True, True] and held.closed_early == [False, False]


def test_a_plain_reply_is_built_at_the_last_finish_and_the_streams_drain_in_the_background():
    async def go():
        held = HeldEnd(1)
        streams = await open_streams(_calls(1), held.entry())
        merged = merge(streams)
        items = [item async for _, item in until_answered(merged, 1)]
        assert [d.finish_reason for d in items] == [None, "length"]
        assert held.ended == [False]
        drain_soon(merged)
        held.release.set()
        await held.over[0].wait()   # the background drain reached the stream's end
        return held

    held = asyncio.run(asyncio.wait_for(go(), LIMIT_S))
    assert held.ended == [True] and held.closed_early == [False]
