"""The OpenAI-compatible HTTP front door (FastAPI), independent of how models are reached.

Order of work per request: authenticate, parse JSON (400), validate shape (422) and values (400),
find the model (404), tokenize and check the context (413), then start the model stream and
peek at its first item so refusals and errors before the first token become proper HTTP errors
rather than a broken 200 stream.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
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
                              invalid_json, model_not_found, sse_error_event, unauthorized,
                              unprocessable)
from serve_app.metrics import CONTENT_TYPE, Metrics
from serve_app.tokens import chat_prompt_ids, load_tokenizer, text_prompt_ids

log = logging.getLogger("orchard.ingress")


class ModelEntry:
    """What the ingress knows about one model; filled lazily from a replica's `info`."""

    def __init__(self, model_id: str, backend: Any):
        self.model_id = model_id
        self.backend = backend
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.format_identity = "?"
        self._lock = asyncio.Lock()

    async def ready(self) -> "ModelEntry":
        if self.tokenizer is None:
            async with self._lock:
                if self.tokenizer is None:
                    info = await self.backend.info()
                    self.max_model_len = int(info["max_model_len"])
                    self.format_identity = info["format_identity"]
                    tok = await asyncio.to_thread(load_tokenizer, info["tokenizer_files"])
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
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise unprocessable(f"{loc}: {err['msg']}", param=loc or None) from None
        P.check_values(req)
        return req

    # --- the request path ---------------------------------------------------------------

    async def build_call(self, kind: str, req, request: Request,
                         trace: dict | None = None) -> tuple[GenerateCall, ModelEntry]:
        entry = self.models.get(req.model)
        if entry is None:
            raise model_not_found(req.model)
        await entry.ready()
        tok = entry.tokenizer
        if kind == "chat":
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            prompt_ids = await _off_loop_if_long(chat_prompt_ids, tok, messages,
                                                 size=sum(len(m["content"]) for m in messages))
        else:
            size = len(req.prompt) if isinstance(req.prompt, str) else 0
            prompt_ids = await _off_loop_if_long(text_prompt_ids, tok, req.prompt, size=size)
            if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= len(tok)):
                raise bad_request("prompt token id out of vocabulary range", param="prompt")
        limit = entry.max_model_len
        if len(prompt_ids) >= limit:
            raise context_exceeded(f"prompt has {len(prompt_ids)} tokens; this model's context "
                                   f"holds {limit} tokens including the completion")
        requested = req.requested_max_tokens()
        max_tokens = requested if requested is not None else limit - len(prompt_ids)
        if len(prompt_ids) + max_tokens > limit:
            raise bad_request(f"max_tokens={max_tokens} plus {len(prompt_ids)} prompt tokens "
                              f"exceeds the context of {limit} tokens", param="max_tokens",
                              code="context_length_exceeded")
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        call = GenerateCall(
            request_id=prefix + uuid.uuid4().hex, model=req.model, prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p), top_k=req.top_k or 0,
            seed=req.seed, stop=req.stop_list(), ignore_eos=req.ignore_eos,
            first_token_deadline_unix=self.deadline_unix(request), trace=trace)
        stamp(trace, "ingress_call_built")
        return call, entry

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

    async def complete(self, kind: str, request: Request) -> Response:
        t0 = time.monotonic()
        trace = {"ingress_in": time.time()} if tracing() else None
        model = "?"
        try:
            self.authenticate(request)
            req = await self.parse(request, P.ChatCompletionRequest if kind == "chat"
                                   else P.CompletionRequest)
            model = req.model
            call, entry = await self.build_call(kind, req, request, trace)
            first, rest = await self.open_stream(call, entry)
        except APIError as e:
            self.metrics.refusals.labels(model if model in self.models else "?", e.reason,
                                         str(e.status)).inc()
            return e.response()
        self.metrics.admissions.labels(model).inc()
        headers = {"x-orchard-replica": first.get("replica_id", "?"),
                   "x-orchard-request-id": call.request_id}
        if trace is not None:
            # Hops after the ingress stamped their copy of the call (it was pickled to them).
            trace.update(first.get("trace") or {})
            stamp(trace, "ingress_first_item")
            headers["x-orchard-trace"] = json.dumps(trace)
        builder = P.ResponseBuilder(kind, call.request_id, model)
        tracker = _Tracker(self.metrics, model, entry.format_identity, t0)
        if req.stream:
            return StreamingResponse(self._sse(builder, first, rest, req.include_usage(), tracker),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        text, finish, usage = [], None, None
        try:
            async for item in _chain(first, rest):
                tracker.delta(item)
                text.append(item["text"])
                finish, usage = item["finish_reason"], item["usage"]
        except Exception as e:  # noqa: BLE001 - a replica lost mid-request: 503 + Retry-After
            err = self._failed_mid_stream(call.request_id, model, e)
            finish = f"error:{err.reason}"
            return err.response()
        finally:
            await rest.aclose()
            tracker.done(finish, usage)
        return JSONResponse(builder.full("".join(text), P.openai_finish_reason(finish),
                                         _usage(usage)), headers=headers)

    async def _sse(self, builder: P.ResponseBuilder, first: dict, rest: AsyncIterator[dict],
                   include_usage: bool, tracker: "_Tracker") -> AsyncIterator[str]:
        finish, usage, is_first = None, None, True
        try:
            try:
                async for item in _chain(first, rest):
                    tracker.delta(item)
                    finish, usage = item["finish_reason"], item["usage"]
                    if item["text"] or is_first:
                        yield builder.chunk(item["text"], None, first=is_first)
                        is_first = False
                    if finish is not None:
                        yield builder.chunk(None, P.openai_finish_reason(finish))
            except Exception as e:  # noqa: BLE001 - after the first byte: an error event
                err = self._failed_mid_stream(builder.id, builder.model, e)
                finish = f"error:{err.reason}"
                yield sse_error_event(err)
                yield P.SSE_DONE
                return
            if include_usage:
                yield builder.chunk(None, None, usage=_usage(usage), no_choices=True)
            yield P.SSE_DONE
        finally:
            await rest.aclose()
            tracker.done(finish or "cancelled", usage)

    def _failed_mid_stream(self, request_id: str, model: str, exc: Exception) -> APIError:
        """Map a failure after the response started; the stream or reply still ends cleanly."""
        err = from_exception(unwrap(exc))
        log.warning("request %s failed mid-stream (%s): %s", request_id, err.code, exc)
        self.metrics.refusals.labels(model, f"mid_stream:{err.reason}", str(err.status)).inc()
        return err

    # --- side endpoints -----------------------------------------------------------------

    def list_models(self) -> dict:
        return {"object": "list", "data": [
            {"id": mid, "object": "model", "created": self.created, "owned_by": "orchard"}
            for mid in self.models]}

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


# Tokenizing a long prompt takes milliseconds; do it off the event loop that serves everyone.
_INLINE_TOKENIZE_CHARS = 8192


async def _off_loop_if_long(fn, *args, size: int):
    if size > _INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _chain(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    # Drain to the end (not just the finishing delta) so the replica's generator completes
    # normally instead of being cancelled.
    yield first
    async for item in rest:
        yield item


def _usage(u: dict | None) -> dict:
    u = u or {}
    return P.usage_dict(u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                        u.get("cached_tokens", 0))


def build_fastapi_app(core: IngressCore) -> FastAPI:
    app = FastAPI(title="Orchard", docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else "http_error"
        return APIError(exc.status_code, str(exc.detail), code=code).response()

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

    @app.get("/health")
    async def health():
        code, body = await core.health()
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics():
        return Response(await core.render_metrics(), media_type=CONTENT_TYPE)

    return app
