"""Request validation and translation: an OpenAI request body becomes one GenerateCall per
choice, or the APIError that refuses it (parse JSON 400, shape 422 and values 400, model 404,
tokenize and check the context 413, the first-token deadline header 400)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from engine.errors import InvalidRequest
from engine.request import GenerationRequest
from serve_app import protocol as P
from serve_app.calls import GenerateCall, stamp
from serve_app.config import OrchardConfig
from serve_app.errors import (APIError, bad_request, context_exceeded, from_exception,
                              invalid_json, model_not_found, tokenize_error, too_large,
                              unknown_parameter, unprocessable)
from serve_app.tokens import chat_prompt, load_tokenizer, text_prompt_ids
from serve_app.tools import ModelTextFormat, ToolPlan, plan_tools

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



@dataclass
class Prepared:
    calls: list[GenerateCall]
    entry: ModelEntry
    plan: ToolPlan | None
    prompt_text: str


async def parse_body(request: Request, model_cls):
    """The request body as `model_cls`, or the APIError (400/422) that refuses it."""
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


class CallBuilder:
    """Builds the calls of one request against the models the ingress knows."""

    def __init__(self, config: OrchardConfig, models: dict[str, ModelEntry],
                 api_keys: list[str]):
        self.config = config
        self.models = models
        self.api_keys = api_keys
        self.deadline_header = config.http.first_token_deadline_header

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

    async def build_calls(self, kind: str, req, request: Request, trace: dict | None = None
                          ) -> Prepared:
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
        if req.requested_max_tokens() is None and req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens={req.min_tokens} exceeds the {max_tokens} tokens "
                              "this request may generate; set max_tokens", param="min_tokens")
        if req.min_tokens > 0 and grammar is not None:
            # Named by its HTTP causes; params.py refuses the same pair for direct engine callers.
            raise bad_request("min_tokens cannot be combined with response_format or a forced "
                              "tool call", param="min_tokens", code="unsupported_parameter")
        params = req.sampling_params(max_tokens, grammar)
        vocab = len(entry.tokenizer)
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise bad_request(f"{name} names token ids outside the vocabulary "
                                  f"(size {vocab})", param=name)
        base = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        deadline, tenant = self.deadline_unix(request), self.tenant_of(request)
        try:
            calls = [GenerateCall(GenerationRequest(
                base if req.n == 1 else f"{base}-{i}", prompt_ids,
                # Choices of one seeded request differ from each other and are reproducible.
                params if params.seed is None or i == 0 else replace(params, seed=params.seed + i),
                tenant=tenant), model=req.model, first_token_deadline_unix=deadline,
                trace=trace if i == 0 else None)
                for i in range(req.n)]
        except InvalidRequest as e:   # e.g. a prompt that tokenizes to nothing
            raise from_exception(e) from None
        stamp(trace, "ingress_call_built")
        return Prepared(calls, entry, plan, prompt_text)

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
