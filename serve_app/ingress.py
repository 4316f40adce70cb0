"""The OpenAI-compatible HTTP front door (FastAPI), independent of how models are reached.

Order of work per request: authenticate, parse JSON (400), validate shape (422) and values (400),
find the model (404), tokenize and check the context (413), then start the model stream and
peek at its first item so refusals and errors before the first token become proper HTTP errors
rather than a broken 200 stream.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import protocol as P
from serve_app.backends import unwrap
from serve_app.calls import GenerateCall, stamp, tracing
from serve_app.config import OrchardConfig
from serve_app.errors import (APIError, bad_request, context_exceeded, from_exception,
                              invalid_json, model_not_found, sse_error_event, tokenize_error,
                              too_large, unauthorized, unknown_parameter, unprocessable)
from serve_app.metrics import CONTENT_TYPE, Metrics
from serve_app.tokens import chat_prompt, load_tokenizer, text_prompt_ids
from serve_app.tools import ModelTextFormat, OutputSplitter, Split, ToolPlan, plan_tools

log = logging.getLogger("orchard.ingress")


class ModelEntry:
    """What the ingress knows about one model; filled lazily from a replica's `info`."""

    def __init__(self, model_id: str, backend: Any):
        self.model_id = model_id
        self.backend = backend
        self.tokenizer: Any = None
        self.text_format = ModelTextFormat()
        self.max_model_len = 0
        self.max_request_tokens = 0
        self.prefix_caching = False
        self.format_identity = "?"
        self._lock = asyncio.Lock()

    async def ready(self) -> "ModelEntry":
        if self.tokenizer is None:
            async with self._lock:
                if self.tokenizer is None:
                    info = await self.backend.info()
                    self.max_model_len = int(info["max_model_len"])
                    self.max_request_tokens = int(info.get("max_request_tokens",
                                                           self.max_model_len))
                    self.prefix_caching = bool(info.get("prefix_caching", False))
                    self.format_identity = info["format_identity"]
                    tok, self.text_format = await asyncio.to_thread(
                        load_tokenizer, info["tokenizer_files"])
                    # We enforce the context ourselves (413/400); silence HF's length warning.
                    tok.model_max_length = 1 << 62
                    self.tokenizer = tok
        return self


class IngressCore:
    def __init__(self, config: OrchardConfig, backends: dict[str, Any],
                 capacity: Any = None, replica_views: Callable[[], list[dict]] | None = None,
                 router_events: Callable[[], dict[str, int]] | None = None):
        self.config = config
        self.models = {mid: ModelEntry(mid, b) for mid, b in backends.items()}
        self.capacity = capacity
        self.replica_views = replica_views or (lambda: [])
        self.router_events = router_events or (lambda: {})
        self.api_keys = config.all_api_keys()
        self.metrics = Metrics()
        self.deadline_header = config.http.first_token_deadline_header
        self.created = int(time.time())

    # --- checks -------------------------------------------------------------------------

    def authenticate(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'",
                               "missing_api_key")
        if scheme.lower() != "bearer" or not any(
                hmac.compare_digest(token.strip(), k) for k in self.api_keys):
            raise unauthorized("incorrect API key provided", "invalid_api_key")

    def tenant_of(self, request: Request) -> str | None:
        """The caller's prefix-cache namespace: one per API key (a digest, never the key), so a
        caller cannot learn from its own first-token time what another key recently sent.
        Without keys every caller shares the engine's one tenant."""
        if not self.api_keys:
            return None
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]

    def deadline_unix(self, request: Request) -> float | None:
        raw = request.headers.get(self.deadline_header)
        if raw is None:
            return None
        try:
            ms = float(raw)
        except ValueError:
            raise bad_request(f"{self.deadline_header} must be milliseconds, got {raw!r}",
                              code="invalid_header") from None
        if not ms > 0:
            raise bad_request(f"{self.deadline_header} must be > 0 ms", code="invalid_header")
        return time.time() + ms / 1000.0

    async def parse(self, request: Request, model_cls):
        body = await request.body()
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid_json(str(e)) from None
        if not isinstance(data, dict):
            raise invalid_json("expected a JSON object")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            errors = e.errors()
            # A field we do not know is a 400 naming it, before any type error.
            extra = next((x for x in errors if x["type"] == "extra_forbidden"), None)
            if extra is not None:
                raise unknown_parameter(_loc(extra["loc"])) from None
            err = errors[0]
            loc = _loc(err["loc"])
            raise unprocessable(f"{loc}: {err['msg']}", param=loc or None) from None
        P.check_values(req)
        return req

    # --- the request path ---------------------------------------------------------------

    async def build_calls(self, kind: str, req, request: Request, trace: dict | None = None
                          ) -> "_Prepared":
        """One GenerateCall per choice (n), or the APIError that refuses the request."""
        entry = self.models.get(req.model)
        if entry is None:
            raise model_not_found(req.model)
        try:
            await entry.ready()
        except Exception as e:  # noqa: BLE001 - a replica that cannot describe its model
            log.warning("model %s not ready: %r", req.model, e)
            raise APIError(503, f"model {req.model!r} is not ready: {type(e).__name__}: {e}",
                           type="service_unavailable", code="model_unavailable",
                           retry_after_s=5.0) from None
        plan, grammar = None, None
        if kind == "chat":
            plan = plan_tools(req, entry.text_format)
            grammar = P.response_grammar(req)
            if grammar is not None and plan is not None and plan.grammar is not None:
                raise bad_request("response_format cannot be combined with a forced tool call "
                                  "(tool_choice)", param="response_format")
            grammar = grammar or (plan.grammar if plan else None)
            for i, m in enumerate(req.messages):
                if m.tool_calls and not entry.text_format.renders_tool_calls:
                    raise bad_request("this model's chat template does not render tool_calls",
                                      param=f"messages[{i}].tool_calls",
                                      code="unsupported_parameter")
        prompt_text, prompt_ids = await self._prompt_ids(kind, req, entry.tokenizer, plan)
        max_tokens = self._max_tokens(req, len(prompt_ids), entry)
        vocab = len(entry.tokenizer)
        for name, ids in (("logit_bias", req.logit_bias_ids()),
                          ("stop_token_ids", req.stop_token_ids or ())):
            if any(t >= vocab for t in ids):
                raise bad_request(f"{name} names token ids outside the vocabulary "
                                  f"(size {vocab})", param=name)
        base = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        deadline, tenant = self.deadline_unix(request), self.tenant_of(request)
        calls = [GenerateCall(
            request_id=base if req.n == 1 else f"{base}-{i}", model=req.model,
            prompt_ids=prompt_ids, max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p), top_k=req.top_k or 0,
            # Choices of one seeded request differ from each other and are reproducible.
            seed=None if req.seed is None else req.seed + i, stop=req.stop_list(),
            ignore_eos=req.ignore_eos, min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None
            else req.repetition_penalty,
            logit_bias=req.logit_bias_ids(), stop_token_ids=list(req.stop_token_ids or ()),
            logprobs=req.logprobs_k(), first_token_deadline_unix=deadline,
            grammar=grammar, tenant=tenant, trace=trace if i == 0 else None)
            for i in range(req.n)]
        stamp(trace, "ingress_call_built")
        return _Prepared(calls, entry, plan, prompt_text)

    async def _prompt_ids(self, kind: str, req, tok, plan: ToolPlan | None
                          ) -> tuple[str, list[int]]:
        """(rendered chat prompt or "", ids); a template or tokenizer failure becomes an
        OpenAI-shaped error."""
        try:
            if kind == "chat":
                messages = [m.template_dict() for m in req.messages]
                return await _off_loop_if_long(chat_prompt, tok, messages,
                                               plan.tools if plan else None,
                                               size=sum(len(m["content"]) for m in messages))
            size = len(req.prompt) if isinstance(req.prompt, str) else 0
            ids = await _off_loop_if_long(text_prompt_ids, tok, req.prompt, size=size)
        except Exception as e:  # noqa: BLE001 - mapped below, never a plain-text 500
            raise tokenize_error(e) from None
        if ids and (min(ids) < 0 or max(ids) >= len(tok)):
            raise bad_request("prompt token id out of vocabulary range", param="prompt")
        return "", ids

    def _max_tokens(self, req, prompt: int, entry: "ModelEntry") -> int:
        """The completion budget: as asked, or the configured default cut to what fits; a
        request that can never fit the context or one replica's KV budget is a 413 now."""
        limit, kv_max = entry.max_model_len, entry.max_request_tokens
        if prompt >= limit:
            raise context_exceeded(f"prompt has {prompt} tokens; this model's context "
                                   f"holds {limit} tokens including the completion")
        if prompt >= kv_max:
            raise too_large(f"prompt has {prompt} tokens; one request on this model can "
                            f"hold at most {kv_max} tokens (prompt + completion) in a "
                            "replica's KV budget")
        requested = req.requested_max_tokens()
        if requested is None:
            return min(self.config.http.default_max_tokens, limit - prompt, kv_max - prompt)
        if prompt + requested > limit:
            raise context_exceeded(f"max_tokens={requested} plus {prompt} prompt tokens "
                                   f"exceeds the context of {limit} tokens",
                                   param="max_tokens")
        if prompt + requested > kv_max:
            raise too_large(f"max_tokens={requested} plus {prompt} prompt tokens exceeds the "
                            f"{kv_max} tokens one request can hold in a replica's KV budget",
                            param="max_tokens")
        return requested

    async def open_stream(self, call: GenerateCall, entry: ModelEntry):
        """Start the model stream; return (first item, rest) or raise the mapped APIError."""
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
        if "error" in first:
            await agen.aclose()
            raise APIError.from_wire(first["error"])
        if first.get("finish_reason") == "deadline" and not first.get("token_ids"):
            await agen.aclose()
            raise APIError(503, "first-token deadline passed before the first token",
                           type="service_unavailable", code="deadline_exceeded",
                           retry_after_s=1.0, reason="deadline")
        return first, agen

    async def open_streams(self, calls: list[GenerateCall], entry: ModelEntry):
        """Every choice's stream; if one is refused the others are closed.

        With the prefix cache on, choice 0 goes first: its first token means its prompt's full
        pages are in the cache, so the other choices share them instead of writing the prompt's
        KV again (they wait one prefill for it). Without the cache all start together."""
        first = []
        if len(calls) == 1 or entry.prefix_caching:
            first = [await self.open_stream(calls[0], entry)]
            calls = calls[1:]
        opened = await asyncio.gather(*(self.open_stream(c, entry) for c in calls),
                                      return_exceptions=True)
        failed = [o for o in opened if isinstance(o, BaseException)]
        if failed:
            for o in [*first, *opened]:
                if not isinstance(o, BaseException):
                    await o[1].aclose()
            raise failed[0]
        return [*first, *opened]

    async def complete(self, kind: str, request: Request) -> Response:
        t0 = time.monotonic()
        trace = {"ingress_in": time.time()} if tracing() else None
        model = "?"
        try:
            try:
                self.authenticate(request)
                req = await self.parse(request, P.ChatCompletionRequest if kind == "chat"
                                       else P.CompletionRequest)
                model = req.model
                prep = await self.build_calls(kind, req, request, trace)
                calls, entry = prep.calls, prep.entry
                streams = await self.open_streams(calls, entry)
            except APIError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever it was, the client gets JSON
                log.exception("request failed before its first token")
                raise from_exception(e) from None
        except APIError as e:
            self.metrics.refusals.labels(model if model in self.models else "?", e.reason,
                                         str(e.status)).inc()
            return e.response()
        self.metrics.admissions.labels(model).inc()
        first = streams[0][0]
        request_id = calls[0].request_id if len(calls) == 1 else calls[0].request_id[:-2]
        headers = {"x-orchard-replica": first.get("replica_id", "?"),
                   "x-orchard-request-id": request_id}
        if trace is not None:
            # Hops after the ingress stamped their copy of the call (it was pickled to them).
            trace.update(first.get("trace") or {})
            stamp(trace, "ingress_first_item")
            headers["x-orchard-trace"] = json.dumps(trace)
        fmt = entry.text_format
        splitter = None
        if kind == "chat" and (prep.plan is not None or fmt.think_start):
            def splitter():
                return OutputSplitter(fmt, prep.plan.tools if prep.plan else None,
                                      prep.prompt_text)
        out = _Choices(kind, P.ResponseBuilder(kind, request_id, model),
                       P.LogprobsFormatter(entry.tokenizer) if calls[0].logprobs is not None
                       else None, _echo_text(req, entry.tokenizer, calls[0].prompt_ids),
                       len(calls), splitter)
        tracker = _Tracker(self.metrics, model, entry.format_identity, t0)
        if req.stream:
            return StreamingResponse(self._sse(out, streams, req.include_usage(), tracker),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        finish, merged = None, _merge(streams)
        try:
            async for index, item in merged:
                tracker.delta(item)
                out.add(index, item)
            finish = out.finish()
        except Exception as e:  # noqa: BLE001 - a replica lost mid-request: 503 + Retry-After
            err = self._failed_mid_stream(request_id, model, e)
            finish = f"error:{err.reason}"
            return err.response()
        finally:
            await merged.aclose()
            tracker.done(finish, out.usage())
        return JSONResponse(out.body(), headers=headers)

    async def _sse(self, out: "_Choices", streams: list, include_usage: bool,
                   tracker: "_Tracker") -> AsyncIterator[str]:
        finish, merged = None, _merge(streams)
        try:
            try:
                async for index, item in merged:
                    tracker.delta(item)
                    for chunk in out.chunks(index, item):
                        yield chunk
                finish = out.finish()
            except Exception as e:  # noqa: BLE001 - after the first byte: an error event
                err = self._failed_mid_stream(out.builder.id, out.builder.model, e)
                finish = f"error:{err.reason}"
                yield sse_error_event(err)
                yield P.SSE_DONE
                return
            if include_usage:
                yield out.builder.chunk(None, None, usage=_usage(out.usage()), no_choices=True)
            yield P.SSE_DONE
        finally:
            await merged.aclose()
            tracker.done(finish or "cancelled", out.usage())

    def _failed_mid_stream(self, request_id: str, model: str, exc: Exception) -> APIError:
        """Map a failure after the response started; the stream or reply still ends cleanly."""
        err = from_exception(unwrap(exc))
        log.warning("request %s failed mid-stream (%s): %s", request_id, err.code, exc)
        self.metrics.refusals.labels(model, f"mid_stream:{err.reason}", str(err.status)).inc()
        return err

    # --- side endpoints -----------------------------------------------------------------

    def list_models(self) -> dict:
        return {"object": "list", "data": [self.model_card(mid) for mid in self.models]}

    def model_card(self, model_id: str) -> dict:
        if model_id not in self.models:
            raise model_not_found(model_id)
        return {"id": model_id, "object": "model", "created": self.created,
                "owned_by": "orchard"}

    async def capacity_feed(self) -> dict:
        if self.capacity is None:
            raise APIError(503, "capacity actor not configured", type="service_unavailable",
                           code="capacity_unavailable", retry_after_s=5)
        try:
            return await self.capacity.snapshot()
        except Exception as e:  # noqa: BLE001 - the feed must not take the ingress down
            raise APIError(503, f"capacity feed unavailable: {type(e).__name__}",
                           type="service_unavailable", code="capacity_unavailable",
                           retry_after_s=5) from None

    async def health(self) -> tuple[int, dict]:
        """200 when every model has answered once and (behind Serve) still has a live replica."""
        status = {}
        live: dict[str, int] = {}
        views = self.replica_views()
        for v in views:
            mid = v["metadata"].get("model_id") or v["routing_stats"].get("model_id")
            live[mid] = live.get(mid, 0) + 1
        for mid, entry in self.models.items():
            try:
                await asyncio.wait_for(entry.ready(), timeout=30)
                status[mid] = "ok" if not views or live.get(mid) else "no running replicas"
            except Exception as e:  # noqa: BLE001
                status[mid] = f"unavailable: {type(e).__name__}"
        ok = all(v == "ok" for v in status.values())
        return (200 if ok else 503), {"status": "ok" if ok else "degraded", "models": status}

    async def render_metrics(self) -> bytes:
        self.metrics.observe_replicas(self.replica_views())
        self.metrics.observe_router(self.router_events())
        if self.capacity is not None:
            try:
                from serve_app.capacity_link import identity_rows

                self.metrics.observe_identities(identity_rows(await self.capacity.snapshot()))
            except Exception:  # noqa: BLE001 - metrics stay available without the actor
                log.debug("capacity snapshot unavailable for /metrics", exc_info=True)
        return self.metrics.render()


class _Tracker:
    """Per-request latency and token accounting for /metrics."""

    def __init__(self, metrics: Metrics, model: str, identity: str, t0: float):
        self.m, self.model, self.identity, self.t0 = metrics, model, identity, t0
        self.last: float | None = None

    def delta(self, item: dict) -> None:
        if not item.get("token_ids"):
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


@dataclass
class _Prepared:
    calls: list[GenerateCall]
    entry: ModelEntry
    plan: ToolPlan | None
    prompt_text: str


class _Choice:
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
        self.usage: dict | None = None

    def take(self, item: dict) -> tuple[Split, bool]:
        """This item's text, split; and whether it is the choice's first item."""
        first, self.started = not self.started, True
        text = item["text"]
        if self.splitter is None:
            split = Split(content=(self.echo if first else "") + text)
        else:
            split = self.splitter.push(text)
            if item["finish_reason"] is not None:
                tail = self.splitter.flush()
                split = Split(split.content + tail.content, split.reasoning + tail.reasoning,
                              split.tool_calls + tail.tool_calls)
        self.content.append(split.content)
        self.reasoning.append(split.reasoning)
        self.tool_calls += split.tool_calls
        self.finish, self.usage = item["finish_reason"], item["usage"]
        return split, first

    def openai_finish(self) -> str | None:
        if self.tool_calls and self.finish == "stop":
            return "tool_calls"
        return P.openai_finish_reason(self.finish)


class _Choices:
    """Accumulates each choice's deltas into the reply body, or turns them into SSE chunks."""

    def __init__(self, kind: str, builder: P.ResponseBuilder,
                 logprobs: P.LogprobsFormatter | None, echo: str, n: int,
                 splitter: Callable[[], OutputSplitter] | None = None):
        self.kind, self.builder, self.lp = kind, builder, logprobs
        self.choices = [_Choice(splitter() if splitter else None, echo) for _ in range(n)]

    def _logprobs(self, c: _Choice, item: dict) -> Any:
        if self.lp is None or not item["token_ids"]:
            return None
        ids, entries = item["token_ids"], item.get("logprobs") or []
        if self.kind == "chat":
            return self.lp.chat(ids, entries)
        return self.lp.text(ids, entries, c.chars)

    def add(self, index: int, item: dict) -> None:
        c = self.choices[index]
        lp = self._logprobs(c, item)
        c.take(item)
        c.chars += len(item["text"])
        if lp is not None:
            c.logprobs.append(lp)

    def chunks(self, index: int, item: dict) -> list[str]:
        c = self.choices[index]
        lp = self._logprobs(c, item)
        split, first = c.take(item)
        c.chars += len(item["text"])
        out = []
        if split.content or split.reasoning or split.tool_calls or first or lp:
            out.append(self.builder.chunk(split.content, None, index=index, first=first,
                                          logprobs=lp, reasoning=split.reasoning or None,
                                          tool_calls=split.tool_calls or None))
        if item["finish_reason"] is not None:
            out.append(self.builder.chunk(None, c.openai_finish(), index=index))
        return out

    def _joined_logprobs(self, c: _Choice) -> Any:
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
        return self.builder.full(out, _usage(self.usage()))

    def finish(self) -> str | None:
        finishes = {c.finish for c in self.choices}
        return finishes.pop() if len(finishes) == 1 else "mixed"

    def usage(self) -> dict | None:
        got = [c.usage for c in self.choices if c.usage]
        if not got:
            return None
        # The prompt is counted once, as OpenAI does for n > 1; cached: the most any choice
        # found in the prefix cache (choices after the first share the first one's pages).
        return {"prompt_tokens": got[0]["prompt_tokens"],
                "completion_tokens": sum(u["completion_tokens"] for u in got),
                "cached_tokens": max(u.get("cached_tokens", 0) for u in got)}


def _echo_text(req, tok, prompt_ids: list[int]) -> str:
    if not getattr(req, "echo", False):
        return ""
    if isinstance(req.prompt, str):
        return req.prompt
    if req.prompt and isinstance(req.prompt[0], str):
        return req.prompt[0]
    return tok.decode(prompt_ids)


async def _merge(streams: list[tuple[dict, AsyncIterator[dict]]]
                 ) -> AsyncIterator[tuple[int, dict]]:
    """(choice index, item) from every choice's stream as they come; all drained to the end
    (not just the finishing delta) so each replica generator completes normally."""
    if len(streams) == 1:
        first, rest = streams[0]
        try:
            yield 0, first
            async for item in rest:
                yield 0, item
        finally:
            await rest.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, first: dict, rest: AsyncIterator[dict]) -> None:
        try:
            await queue.put((index, first, None))
            async for item in rest:
                await queue.put((index, item, None))
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


# Tokenizing a long prompt takes milliseconds; do it off the event loop that serves everyone.
_INLINE_TOKENIZE_CHARS = 8192


async def _off_loop_if_long(fn, *args, size: int):
    if size > _INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _loc(loc: tuple) -> str:
    """A pydantic error location as the client wrote it: messages[0].content."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _usage(u: dict | None) -> dict:
    u = u or {}
    return P.usage_dict(u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                        u.get("cached_tokens", 0))


def build_fastapi_app(core: IngressCore) -> FastAPI:
    app = FastAPI(title="Orchard", docs_url=None, redoc_url=None)
    if core.config.http.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=core.config.http.cors_origins,
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=["x-orchard-replica", "x-orchard-request-id"])

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else "http_error"
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        # Anything unmapped still answers OpenAI-shaped JSON (500), never plain text.
        log.exception("unhandled error")
        return from_exception(exc).response()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await core.complete("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await core.complete("text", request)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            core.authenticate(request)
        except APIError as e:
            return e.response()
        return core.list_models()

    @app.get("/v1/models/capacity")
    async def capacity(request: Request):
        try:
            core.authenticate(request)
            return await core.capacity_feed()
        except APIError as e:
            return e.response()

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, request: Request):
        try:
            core.authenticate(request)
            return core.model_card(model_id)
        except APIError as e:
            return e.response()

    @app.get("/health")
    async def health():
        code, body = await core.health()
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics():
        return Response(await core.render_metrics(), media_type=CONTENT_TYPE)

    return app
