"""The reply side of the ingress: open each choice's replica stream (peeking at its first item,
so refusals before the first token become HTTP errors), merge the choices' ReplicaDeltas
(serve_app/wire.py) into their engine Deltas, and turn those into one JSON body or SSE chunks,
with per-request metrics."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from engine.request import Delta, Usage
from serve_app import protocol as P
from serve_app.backends import unwrap
from serve_app.calls import GenerateCall
from serve_app.errors import APIError, from_exception, sse_error_event
from serve_app.metrics import Metrics
from serve_app.tools import OutputSplitter, Split
from serve_app.translate import ModelEntry
from serve_app.wire import ReplicaDelta, ReplicaError

log = logging.getLogger("orchard.ingress")


def caller_name() -> str | None:
    """This process's Ray actor name (the ingress replica's), or None outside a Ray actor."""
    try:
        import ray

        return ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not an actor (in-process use, tests, bench)
        return None


async def open_stream(call: GenerateCall, entry: ModelEntry):
    """Start the model stream; return (first item, rest) or raise the mapped APIError."""
    if call.caller is None:
        call.caller = caller_name()
    agen = entry.backend.stream(call)
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        raise APIError(500, "model returned no output", type="server_error",
                       code="internal_error") from None
    except (asyncio.CancelledError, GeneratorExit):
        await agen.aclose()
        raise
    except Exception as e:  # noqa: BLE001 - router refusals and Ray errors land here
        await agen.aclose()
        raise from_exception(unwrap(e)) from None
    if isinstance(first, ReplicaError):
        await agen.aclose()
        raise APIError.from_wire(first.error)
    if first.delta.finish_reason == "deadline" and not first.delta.token_ids:
        await agen.aclose()
        raise APIError(503, "first-token deadline passed before the first token",
                       type="service_unavailable", code="deadline_exceeded",
                       retry_after_s=1.0, reason="deadline")
    if first.delta.finish_reason == "memory" and not first.delta.token_ids:
        await agen.aclose()
        raise kv_memory_unavailable()
    return first, agen


def kv_memory_unavailable() -> APIError:
    """The engine finished a request with reason "memory": its KV pool could not grow."""
    return APIError(503, "the replica could not allocate KV memory for this request "
                    "(its pool could not grow: another process holds the memory)",
                    type="service_unavailable", code="kv_memory_unavailable",
                    retry_after_s=2.0, reason="memory")


async def choice_deltas(first: ReplicaDelta, rest: AsyncIterator[ReplicaDelta]
                        ) -> AsyncIterator[Delta]:
    """One choice's engine deltas. A "memory" finish after the first token (the pool could not
    grow for the request's next page) is a failure, not an end: its tokens go out, then it
    raises, so a stream ends with the kv_memory_unavailable error event and a plain request
    answers 503 instead of a reply cut short as if it were complete."""
    item = first
    while True:
        d = item.delta
        if d.finish_reason == "memory":
            if d.token_ids:
                yield replace(d, finish_reason=None)
            raise kv_memory_unavailable()
        yield d
        try:
            item = await rest.__anext__()
        except StopAsyncIteration:
            return


async def open_streams(calls: list[GenerateCall], entry: ModelEntry):
    """Every choice's stream; if one is refused the others are closed.

    With the prefix cache on, choice 0 goes first: its first token means its prompt's full
    pages are in the cache, so the other choices share them instead of writing the prompt's
    KV again (they wait one prefill for it). Without the cache all start together."""
    first = []
    if len(calls) == 1 or entry.prefix_caching:
        first = [await open_stream(calls[0], entry)]
        calls = calls[1:]
    opened = await asyncio.gather(*(open_stream(c, entry) for c in calls),
                                  return_exceptions=True)
    failed = [o for o in opened if isinstance(o, BaseException)]
    if failed:
        for o in [*first, *opened]:
            if not isinstance(o, BaseException):
                await o[1].aclose()
        raise failed[0]
    return [*first, *opened]


class Tracker:
    """Per-request latency and token accounting for /metrics."""

    def __init__(self, metrics: Metrics, model: str, identity: str, t0: float):
        self.m, self.model, self.identity, self.t0 = metrics, model, identity, t0
        self.last: float | None = None

    def delta(self, item: Delta) -> None:
        if not item.token_ids:
            return
        now = time.monotonic()
        if self.last is None:
            self.m.ttft.labels(self.model, self.identity).observe(now - self.t0)
        else:
            self.m.itl.labels(self.model, self.identity).observe(now - self.last)
        self.last = now

    def done(self, finish: str | None, usage: dict | None) -> None:
        self.m.e2e.labels(self.model, self.identity).observe(time.monotonic() - self.t0)
        self.m.success.labels(self.model, finish or "cancelled").inc()
        if usage:
            self.m.prompt_tokens.labels(self.model).inc(usage["prompt_tokens"])
            self.m.generation_tokens.labels(self.model).inc(usage["completion_tokens"])
            self.m.cached_tokens.labels(self.model).inc(usage.get("cached_tokens", 0))


class Choice:
    """One choice's output so far: text (split into content, reasoning and tool calls when the
    request has tools or the model thinks), logprobs, finish and usage."""

    def __init__(self, splitter: OutputSplitter | None, echo: str):
        self.splitter = splitter
        self.started = False
        self.echo = echo
        self.chars = len(echo)      # text offsets for completions' logprobs
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[dict] = []
        self.logprobs: list = []
        self.finish: str | None = None
        self.usage: Usage | None = None

    def take(self, item: Delta) -> tuple[Split, bool]:
        """This item's text, split; and whether it is the choice's first item."""
        first, self.started = not self.started, True
        text = item.text
        if self.splitter is None:
            split = Split(content=(self.echo if first else "") + text)
        else:
            split = self.splitter.push(text)
            if item.finish_reason is not None:
                tail = self.splitter.flush()
                split = Split(split.content + tail.content, split.reasoning + tail.reasoning,
                              split.tool_calls + tail.tool_calls)
        self.content.append(split.content)
        self.reasoning.append(split.reasoning)
        self.tool_calls += split.tool_calls
        self.finish, self.usage = item.finish_reason, item.usage
        return split, first

    def openai_finish(self) -> str | None:
        if self.tool_calls and self.finish == "stop":
            return "tool_calls"
        return P.openai_finish_reason(self.finish)


class Choices:
    """Accumulates each choice's deltas into the reply body, or turns them into SSE chunks."""

    def __init__(self, kind: str, builder: P.ResponseBuilder,
                 logprobs: P.LogprobsFormatter | None, echo: str, n: int,
                 splitter: Callable[[], OutputSplitter] | None = None):
        self.kind, self.builder, self.lp = kind, builder, logprobs
        self.choices = [Choice(splitter() if splitter else None, echo) for _ in range(n)]

    def _logprobs(self, c: Choice, item: Delta) -> Any:
        if self.lp is None or not item.token_ids:
            return None
        ids, entries = item.token_ids, item.logprobs or ()
        if self.kind == "chat":
            return self.lp.chat(ids, entries)
        return self.lp.text(ids, entries, c.chars)

    def add(self, index: int, item: Delta) -> None:
        c = self.choices[index]
        lp = self._logprobs(c, item)
        c.take(item)
        c.chars += len(item.text)
        if lp is not None:
            c.logprobs.append(lp)

    def chunks(self, index: int, item: Delta, usage: bool = False) -> list[str]:
        """This item's SSE chunks; `usage`: each carries the request's usage so far (vLLM's
        continuous_usage_stats: completion tokens of all choices up to this item)."""
        c = self.choices[index]
        lp = self._logprobs(c, item)
        split, first = c.take(item)
        c.chars += len(item.text)
        so_far = usage_body(self.usage()) if usage else None
        out = []
        if split.content or split.reasoning or split.tool_calls or first or lp:
            out.append(self.builder.chunk(split.content, None, index=index, first=first,
                                          logprobs=lp, reasoning=split.reasoning or None,
                                          tool_calls=split.tool_calls or None, usage=so_far))
        if item.finish_reason is not None:
            out.append(self.builder.chunk(None, c.openai_finish(), index=index, usage=so_far))
        return out

    def _joined_logprobs(self, c: Choice) -> Any:
        if self.lp is None:
            return None
        if self.kind == "chat":
            return [e for p in c.logprobs for e in p]
        return {k: [v for p in c.logprobs for v in p[k]]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    def body(self) -> dict:
        out = []
        for c in self.choices:
            text = "".join(c.content)
            d = {"text": text if text or not c.tool_calls else None,
                 "finish": c.openai_finish(), "logprobs": self._joined_logprobs(c)}
            if self.kind == "chat":
                d.update(reasoning="".join(c.reasoning) or None, tool_calls=c.tool_calls or None)
            out.append(d)
        return self.builder.full(out, usage_body(self.usage()))

    def finish(self) -> str | None:
        finishes = {c.finish for c in self.choices}
        return finishes.pop() if len(finishes) == 1 else "mixed"

    def usage(self) -> dict | None:
        got = [c.usage for c in self.choices if c.usage]
        if not got:
            return None
        # The prompt is counted once, as OpenAI does for n > 1; cached: the most any choice
        # found in the prefix cache (choices after the first share the first one's pages).
        return {"prompt_tokens": got[0].prompt_tokens,
                "completion_tokens": sum(u.completion_tokens for u in got),
                "cached_tokens": max(u.cached_tokens for u in got)}


def echo_text(req, tok, prompt_ids: list[int]) -> str:
    if not getattr(req, "echo", False):
        return ""
    if isinstance(req.prompt, str):
        return req.prompt
    if req.prompt and isinstance(req.prompt[0], str):
        return req.prompt[0]
    return tok.decode(prompt_ids)


async def merge(streams: list[tuple[ReplicaDelta, AsyncIterator[ReplicaDelta]]]
                ) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, engine delta) from every choice's stream as they come; all drained to the
    end (not just the finishing delta) so each replica generator completes normally."""
    if len(streams) == 1:
        first, rest = streams[0]
        try:
            async for d in choice_deltas(first, rest):
                yield 0, d
        finally:
            await rest.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, first: ReplicaDelta, rest: AsyncIterator[ReplicaDelta]) -> None:
        try:
            async for d in choice_deltas(first, rest):
                await queue.put((index, d, None))
            await queue.put((index, None, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((index, None, e))

    tasks = [asyncio.create_task(pump(i, f, r)) for i, (f, r) in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                live -= 1
                continue
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, rest in streams:
            await rest.aclose()


async def until_answered(merged: AsyncIterator[tuple[int, Delta]], n: int
                         ) -> AsyncIterator[tuple[int, Delta]]:
    """`merged`'s items up to the one that finishes the last of the n choices, then stop: the
    answer is complete there. The replica stream's own end (its generator settling the request,
    Ray reporting end-of-stream) comes one round trip later; a client waiting on it would see
    that trip in every reply's latency (0.18 ms a token of a 64-token reply on the H200)."""
    finished: set[int] = set()
    async for index, item in merged:
        yield index, item
        if item.finish_reason is not None:
            finished.add(index)
            if len(finished) == n:
                return


async def drain(merged: AsyncIterator[tuple[int, Delta]]) -> None:
    """Read `merged` to its natural end after the answer went out, so each replica generator
    completes (settles its request) instead of being cancelled; what fails now cannot reach
    the client, whose reply is already whole, so it is only logged."""
    try:
        async for _ in merged:
            pass
    except Exception:  # noqa: BLE001 - the reply was complete; the replica settles on its own
        log.debug("replica stream failed after its reply was complete", exc_info=True)
    finally:
        await merged.aclose()


_draining: set[asyncio.Task] = set()   # strong references: a bare task may be collected


def drain_soon(merged: AsyncIterator[tuple[int, Delta]]) -> None:
    """`drain` in the background (a JSON reply is sent only after its handler returns)."""
    task = asyncio.get_running_loop().create_task(drain(merged))
    _draining.add(task)
    task.add_done_callback(_draining.discard)


def usage_body(u: dict | None) -> dict:
    u = u or {}
    return P.usage_dict(u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                        u.get("cached_tokens", 0))


async def sse(out: Choices, streams: list, include_usage: P.UsageStats, tracker: Tracker,
              failed_mid_stream: Callable[[str, str, Exception], APIError]
              ) -> AsyncIterator[str]:
    """The SSE body of a streamed reply; a failure after the first byte ends it with an error
    event (`failed_mid_stream` maps and counts it). Usage comes in a last chunk with no choices
    (FINAL), and also on every chunk (CONTINUOUS)."""
    finish, merged, answered = None, merge(streams), False
    try:
        try:
            async for index, item in until_answered(merged, len(out.choices)):
                tracker.delta(item)
                for chunk in out.chunks(index, item,
                                        include_usage == P.UsageStats.CONTINUOUS):
                    yield chunk
            finish = out.finish()
        except Exception as e:  # noqa: BLE001 - after the first byte: an error event
            err = failed_mid_stream(out.builder.id, out.builder.model, e)
            finish = f"error:{err.reason}"
            yield sse_error_event(err)
            yield P.SSE_DONE
            return
        if include_usage:
            yield out.builder.chunk(None, None, usage=usage_body(out.usage()), no_choices=True)
        yield P.SSE_DONE
        answered = True
    finally:
        tracker.done(finish or "cancelled", out.usage())
        if not answered:
            await merged.aclose()
    await drain(merged)   # after [DONE]: the client is no longer waiting
