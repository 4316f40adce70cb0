"""The OpenAI-compatible HTTP front door (FastAPI), independent of how models are reached.

Order of work per request: authenticate, parse JSON (400), validate shape (422) and values (400),
find the model (404), tokenize and check the context (413) (serve_app/translate.py), then start
the model stream and peek at its first item so refusals and errors before the first token become
proper HTTP errors rather than a broken 200 stream (serve_app/streaming.py).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from functools import partial
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import protocol as P
from serve_app.backends import unwrap
from serve_app.calls import stamp, tracing
from serve_app.capacity_link import identity_rows
from serve_app.config import OrchardConfig
from serve_app.errors import APIError, from_exception, model_not_found, unauthorized
from serve_app.metrics import CONTENT_TYPE, Metrics
from serve_app.streaming import (Choices, Tracker, drain_soon, echo_text, merge, open_streams, sse,
                                 until_answered)
from serve_app.tools import OutputSplitter
from serve_app.translate import CallBuilder, ModelEntry, parse_body

log = logging.getLogger("orchard.ingress")


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
        self.calls = CallBuilder(config, self.models, self.api_keys)
        self.metrics = Metrics()
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

    # --- the request path ---------------------------------------------------------------

    async def complete(self, kind: str, request: Request) -> Response:
        t0 = time.monotonic()
        trace = {"ingress_in": time.time()} if tracing() else None
        model = "?"
        try:
            try:
                self.authenticate(request)
                req = await parse_body(request, P.ChatCompletionRequest if kind == "chat"
                                       else P.CompletionRequest)
                model = req.model
                prep = await self.calls.build_calls(kind, req, request, trace)
                calls, entry = prep.calls, prep.entry
                streams = await open_streams(calls, entry)
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
        first, asked = streams[0][0], calls[0].request
        request_id = asked.request_id if len(calls) == 1 else asked.request_id[:-2]
        headers = {"x-orchard-replica": first.replica_id or "?",
                   "x-orchard-request-id": request_id}
        if trace is not None:
            # Hops after the ingress stamped their copy of the call (it was pickled to them).
            trace.update(first.trace or {})
            stamp(trace, "ingress_first_item")
            headers["x-orchard-trace"] = json.dumps(trace)
        fmt = entry.text_format
        splitter = None
        if kind == "chat" and (prep.plan is not None or fmt.think_start):
            splitter = partial(OutputSplitter, fmt, prep.plan.tools if prep.plan else None,
                               prep.prompt_text)
        out = Choices(kind, P.ResponseBuilder(kind, request_id, model),
                      P.LogprobsFormatter(entry.tokenizer) if asked.params.logprobs is not None
                      else None, echo_text(req, entry.tokenizer, asked.prompt_ids),
                      len(calls), splitter)
        tracker = Tracker(self.metrics, model, entry.format_identity, t0)
        if req.stream:
            return StreamingResponse(sse(out, streams, req.include_usage(), tracker,
                                         self._failed_mid_stream),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        finish, merged = None, merge(streams)
        try:
            async for index, item in until_answered(merged, len(calls)):
                tracker.delta(item)
                out.add(index, item)
            finish = out.finish()
        except Exception as e:  # noqa: BLE001 - a replica lost mid-request: 503 + Retry-After
            err = self._failed_mid_stream(request_id, model, e)
            finish = f"error:{err.reason}"
            return err.response()
        finally:
            if finish is None or finish.startswith("error:"):
                await merged.aclose()
            tracker.done(finish, out.usage())
        drain_soon(merged)   # the replica streams end after the reply is complete
        return JSONResponse(out.body(), headers=headers)

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
                self.metrics.observe_identities(identity_rows(await self.capacity.snapshot()))
            except Exception:  # noqa: BLE001 - metrics stay available without the actor
                log.debug("capacity snapshot unavailable for /metrics", exc_info=True)
        return self.metrics.render()


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

