"""OpenAI wire models: requests (validated), responses and SSE chunks (built as plain dicts).

Type errors are pydantic's job (-> 422); value errors (negative max_tokens, n > 1, ...) are
checked in `check_values` (-> 400), so clients can tell "wrong shape" from "wrong number".
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from serve_app.errors import bad_request


class _Req(BaseModel):
    # OpenAI clients send many optional fields we do not use; ignore rather than refuse them.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Req):
    include_usage: StrictBool = False


class ContentPart(_Req):
    type: str
    text: str | None = None


class ChatMessage(_Req):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = [p.text or "" for p in self.content if p.type in ("text", "input_text")]
        return "".join(parts)


class _Sampling(_Req):
    model: str
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: str | None = None
    ignore_eos: StrictBool = False   # vLLM's extension: generate max_tokens (benchmarks, tests)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt]
    echo: StrictBool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


MAX_STOP_STRINGS = 4


def check_values(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Value checks OpenAI answers with 400."""
    mt = req.requested_max_tokens()
    if mt is not None and mt < 1:
        raise bad_request(f"max_tokens must be >= 1, got {mt}", param="max_tokens")
    if req.n != 1:
        raise bad_request("only n=1 is supported", param="n")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {req.temperature}",
                          param="temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k is not None and req.top_k < 0:
        raise bad_request(f"top_k must be >= 0, got {req.top_k}", param="top_k")
    stops = req.stop_list()
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise bad_request(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings",
                          param="stop")
    if isinstance(req, ChatCompletionRequest) and not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    if isinstance(req, CompletionRequest):
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
            if len(req.prompt) != 1:
                raise bad_request("only one prompt per request is supported", param="prompt")
        if req.echo:
            raise bad_request("echo is not supported", param="prompt")
        if req.prompt in ("", []):
            raise bad_request("prompt must not be empty", param="prompt")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def openai_finish_reason(reason: str | None) -> str | None:
    # "cancelled"/"deadline" are ours; OpenAI clients know stop/length only.
    return {"stop": "stop", "length": "length"}.get(reason, reason and "stop")


class ResponseBuilder:
    """Builds response bodies and SSE chunks for one request (chat or text completion)."""

    def __init__(self, kind: Literal["chat", "text"], request_id: str, model: str):
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _choice(self, text: str | None, finish: str | None, *, delta: bool,
                first: bool = False) -> dict:
        if self.kind == "text":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if delta:
            d: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                d["content"] = text
            elif first:
                d["content"] = ""
            return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}

    def full(self, text: str, finish: str | None, usage: dict) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [self._choice(text, finish, delta=False)],
                "usage": usage}

    def chunk(self, text: str | None, finish: str | None, *, first: bool = False,
              usage: dict | None = None, no_choices: bool = False) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {
            "id": self.id, "object": obj, "created": self.created, "model": self.model,
            "choices": [] if no_choices else [self._choice(text, finish, delta=True, first=first)],
        }
        if usage is not None:
            body["usage"] = usage
        return sse(body)


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
