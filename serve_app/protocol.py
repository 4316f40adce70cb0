"""OpenAI wire models: requests (validated), responses and SSE chunks (built as plain dicts).

Every request field is implemented, refused, or on the short list of safely ignored fields
(`IGNORED_FIELDS`, docs/api.md): a field we do not know is refused with a 400 naming it rather
than dropped, so a client never gets a 200 that silently ignored what it asked for.
Type errors are pydantic's job (-> 422); unknown fields and value errors (negative max_tokens,
tools, ...) are 400s naming the field, so clients can tell "wrong shape" from "not supported".
Here live only the wire's shape and OpenAI-only rules (n, how many stop strings and logit_bias
entries, logprobs by their wire names); every sampling value's range is declared once, with its
field, in engine/sampling/params.py, and `_Sampling.sampling_params` builds that one shape.
"""
from __future__ import annotations

import json
import time
from enum import IntEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from engine.sampling.params import MAX_LOGPROBS, InvalidSampling, SamplingParams
from serve_app.errors import bad_request

MAX_STOP_STRINGS = 4      # OpenAI's limit (the engine's own, larger, is in params.py)
MAX_N = 8                 # choices per request (each is a full request to the engine)
# OpenAI's limit, which is the engine's: checked here only because the wire names the field
# top_logprobs (chat) or logprobs (completions).
MAX_TOP_LOGPROBS = MAX_LOGPROBS
MAX_LOGIT_BIAS = 300      # entries, as OpenAI

# Accepted and ignored: they change nothing about the tokens a request gets.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier",
                  "prompt_cache_key", "parallel_tool_calls")


class _Req(BaseModel):
    # Unknown fields are refused (mapped to a 400 naming the field in the ingress).
    model_config = ConfigDict(extra="forbid")


class UsageStats(IntEnum):
    """Where a stream reports usage: nowhere, a final chunk, or also every chunk (vLLM's
    `continuous_usage_stats`, which counts only together with include_usage, as in vLLM)."""
    NONE, FINAL, CONTINUOUS = range(3)


class StreamOptions(_Req):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False   # vLLM's extension (GuideLLM sends it)
    include_obfuscation: Any = None   # ignored: padding against side channels, not content


class ContentPart(BaseModel):
    # Part kinds are checked in check_values (an image part gets a 400 naming it).
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Req):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None            # passed to the chat template
    tool_call_id: str | None = None    # passed to the chat template
    tool_calls: list[dict] | None = None   # passed to the template when it renders them
    refusal: Any = None                # ignored: an earlier assistant turn's refusal text

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text or "" for p in self.content)

    def template_dict(self) -> dict:
        from serve_app.tools import history_tool_calls

        d: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = history_tool_calls(self.tool_calls)
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class _Sampling(_Req):
    model: str
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None   # vLLM's extension
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None         # vLLM's extension
    logit_bias: dict[str, float] | None = None
    ignore_eos: StrictBool = False   # vLLM's extension: generate max_tokens (benchmarks, tests)
    min_tokens: StrictInt = 0        # vLLM's extension: no EOS / stop before this many tokens
    # Safely ignored (IGNORED_FIELDS).
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    parallel_tool_calls: Any = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> UsageStats:
        so = self.stream_options or StreamOptions()
        return UsageStats(so.include_usage * (1 + so.continuous_usage_stats))

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def sampling_params(self, max_tokens: int, grammar: str | None) -> SamplingParams:
        """The engine's parameters for this request (fields left out take the engine's
        defaults); a value out of its range is the 400 naming the field."""
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                     min_p=self.min_p, presence_penalty=self.presence_penalty,
                     frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty)
        try:
            return SamplingParams(
                max_tokens=max_tokens, seed=self.seed, stop=tuple(self.stop_list()),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, logit_bias=tuple(self.logit_bias_ids().items()),
                logprobs=self.logprobs_k(), grammar=grammar,
                **{k: v for k, v in given.items() if v is not None})
        except InvalidSampling as e:
            raise bad_request(str(e), param=e.param) from None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: Any = None          # checked against the model's template (serve_app/tools.py)
    tool_choice: Any = None
    # Known and refused unless neutral (check_values): not served.
    functions: Any = None
    function_call: Any = None
    response_format: dict | None = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def logprobs_k(self) -> int | None:
        """None: no logprobs; k: the sampled token's plus k alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def json_schema(self) -> str | None:
        """The JSON schema (as JSON text) the output must match, or None for free text."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text" and set(rf) == {"type"}:
            return None
        if rf.get("type") == "json_object" and set(rf) == {"type"}:
            return json.dumps({"type": "object"})
        spec = rf.get("json_schema")
        if rf.get("type") != "json_schema" or set(rf) != {"type", "json_schema"} \
                or not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict) \
                or not set(spec) <= {"name", "schema", "strict", "description"}:
            raise bad_request("response_format must be {type: text}, {type: json_object} or "
                              "{type: json_schema, json_schema: {name, schema, strict}}",
                              param="response_format")
        # An absent schema allows any JSON value, as OpenAI's json_schema without one.
        return json.dumps(spec.get("schema", {}))


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: Any = None     # refused unless empty (no fill-in-the-middle)
    best_of: Any = None    # refused unless it equals n (no server-side ranking)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        return self.logprobs


# Refused fields and the values that ask for nothing (a client may send these explicitly).
_NEUTRAL = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "reasoning_effort": (None,), "suffix": (None, ""),
}
_TEXT_PARTS = ("text", "input_text")


def check_values(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Value checks OpenAI answers with 400 that are the wire's own (ranges: params.py)."""
    for name, neutral in _NEUTRAL.items():
        if name in type(req).model_fields and getattr(req, name) not in neutral:
            raise bad_request(f"{name} is not supported by this server", param=name,
                              code="unsupported_parameter")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    _check_logit_bias(req.logit_bias)
    if len(req.stop_list()) > MAX_STOP_STRINGS:
        raise bad_request(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings",
                          param="stop")
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)
    else:
        _check_completion(req)


def _check_logit_bias(bias: dict[str, float] | None) -> None:
    if not bias:
        return
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens",
                          param="logit_bias")
    for k in bias:
        if not k.isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {k!r}",
                              param="logit_bias")


def response_grammar(req: ChatCompletionRequest) -> str | None:
    """The llguidance grammar of `response_format`, compiled here so an unsupported schema is a
    400 before any model is reached (None: free text)."""
    schema = req.json_schema()
    if schema is None:
        return None
    from engine.errors import InvalidRequest
    from engine.sampling.structured import json_grammar

    try:
        return json_grammar(schema)
    except InvalidRequest as e:
        raise bad_request(f"response_format: {e}", param="response_format") from None


def _check_chat(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type not in _TEXT_PARTS:
                raise bad_request(f"content parts of type {part.type!r} are not supported "
                                  "(text only)", param=f"messages[{i}].content[{j}].type",
                                  code="unsupported_parameter")
            extra = sorted(set(part.model_extra or ()))
            if extra:
                raise bad_request(f"Unrecognized request argument supplied: {extra[0]}",
                                  param=f"messages[{i}].content[{j}].{extra[0]}",
                                  code="unknown_parameter")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
                              param="top_logprobs")
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


def _check_completion(req: CompletionRequest) -> None:
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        if len(req.prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
    if req.prompt in ("", [], [""]):
        raise bad_request("prompt must not be empty", param="prompt")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported (no server-side ranking)",
                          param="best_of", code="unsupported_parameter")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (prompt logprobs are not "
                          "computed)", param="echo", code="unsupported_parameter")


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def openai_finish_reason(reason: str | None) -> str | None:
    # "cancelled"/"deadline" are ours; OpenAI clients know stop/length only.
    return {"stop": "stop", "length": "length"}.get(reason, reason and "stop")


class LogprobsFormatter:
    """Engine logprob entries (engine.sampling.params.TokenLogprob per token) -> OpenAI's shapes.

    Token strings are each id decoded alone; `bytes` are that string's UTF-8 bytes."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer

    def _piece(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def chat(self, token_ids: list[int], entries: list) -> list[dict]:
        def one(t, lp):
            s = self._piece(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return [{**one(t, e.logprob), "top_logprobs": [one(a, alp) for a, alp in e.top]}
                for t, e in zip(token_ids, entries)]

    def text(self, token_ids: list[int], entries: list, offset: int) -> dict:
        """Legacy completions shape; `offset` = characters of text before the first token."""
        tokens = [self._piece(t) for t in token_ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._piece(a): alp for a, alp in e.top} for e in entries],
                "text_offset": offsets}


class ResponseBuilder:
    """Builds response bodies and SSE chunks for one request (chat or text completion)."""

    def __init__(self, kind: Literal["chat", "text"], request_id: str, model: str):
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _choice(self, index: int, text: str | None, finish: str | None, *, delta: bool,
                first: bool = False, logprobs: Any = None, reasoning: str | None = None,
                tool_calls: list | None = None) -> dict:
        if self.kind == "text":
            return {"index": index, "text": text or "", "logprobs": logprobs,
                    "finish_reason": finish}
        lp = None if logprobs is None else {"content": logprobs, "refusal": None}
        extra = {k: v for k, v in (("reasoning_content", reasoning),
                                     ("tool_calls", tool_calls)) if v}
        if delta:
            d: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                d["content"] = text
            elif first:
                d["content"] = ""
            return {"index": index, "delta": {**d, **extra}, "logprobs": lp,
                    "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text, **extra},
                "logprobs": lp, "finish_reason": finish}

    def full(self, choices: list[dict], usage: dict) -> dict:
        """`choices`: per choice (index order) text, finish and optionally logprobs,
        reasoning, tool_calls."""
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model,
                "choices": [self._choice(i, c.pop("text"), c.pop("finish"), delta=False, **c)
                            for i, c in enumerate(choices)],
                "usage": usage}

    def chunk(self, text: str | None, finish: str | None, *, index: int = 0,
              first: bool = False, logprobs: Any = None, usage: dict | None = None,
              no_choices: bool = False, reasoning: str | None = None,
              tool_calls: list | None = None) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {
            "id": self.id, "object": obj, "created": self.created, "model": self.model,
            "choices": [] if no_choices else [self._choice(
                index, text, finish, delta=True, first=first, logprobs=logprobs,
                reasoning=reasoning, tool_calls=tool_calls)],
        }
        if usage is not None:
            body["usage"] = usage
        return sse(body)


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
