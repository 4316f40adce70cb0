"""vLLM's request extensions that benchmark clients send (GuideLLM, vLLM's benchmark_serving,
genai-perf, llmperf), over real HTTP (tests/api_server.py) on the tiny llama:
`stream_options.continuous_usage_stats` (usage on every chunk), `min_tokens`, `ignore_eos`,
and the exact bodies GuideLLM 0.8 builds (guidellm/backends/openai/request_handlers.py)."""
import json

import httpx
import pytest

from tests.api_server import served
from tests.engine_helpers import prompt

MODEL = "tiny-llama"
EARLY_EOS = prompt(21, 1)   # greedy: the tiny llama ends this prompt with EOS at its 6th token


@pytest.fixture(scope="module")
def url(tiny_llama):
    with served([{"id": MODEL, "path": tiny_llama, "max_num_seqs": 4, "warmup": False}]) as u:
        yield u


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def events(http, path: str, body: dict) -> list[dict]:
    """The JSON events of one streamed reply, in order (checks it ends with [DONE])."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def refused(http, path: str, body: dict, param: str, status: int = 400) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def _tokens_in(chunk: dict) -> int:
    """Tokens a chunk carries, from its logprobs (one entry per token, chat and text alike)."""
    lp = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
    if not lp:
        return 0
    return len(lp["content"]) if "content" in lp else len(lp["tokens"])


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count with me"}],
                              "logprobs": True}),
    ("/v1/completions", {"prompt": "def f(x):", "logprobs": 0}),
], ids=["chat", "completions"])
def test_continuous_usage_stats_on_every_chunk_with_running_counts(http, path, extra):
    body = {"model": MODEL, "max_tokens": 9, "ignore_eos": True, "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **extra}
    evs = events(http, path, body)
    final = evs[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 9
    prompt_tokens = final["usage"]["prompt_tokens"]
    seen = 0
    for ev in evs[:-1]:
        seen += _tokens_in(ev)
        u = ev["usage"]
        assert u["prompt_tokens"] == prompt_tokens and u["completion_tokens"] == seen, (ev, seen)
        assert u["total_tokens"] == prompt_tokens + seen
    assert seen == 9 and evs[-2]["choices"][0]["finish_reason"] == "length"


def test_usage_stays_on_the_last_chunk_without_continuous_stats(http):
    base = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, "stream": True}
    # vLLM's rule: continuous_usage_stats counts only together with include_usage.
    for so in ({"include_usage": True}, {"continuous_usage_stats": True},
               {"include_usage": True, "continuous_usage_stats": False}):
        evs = events(http, "/v1/completions", {**base, "stream_options": so})
        with_usage = [e for e in evs if "usage" in e]
        assert with_usage == ([evs[-1]] if so.get("include_usage") else []), so


def test_min_tokens_forces_tokens_past_eos_over_http(http):
    body = {"model": MODEL, "prompt": EARLY_EOS, "max_tokens": 32, "temperature": 0}
    plain = http.post("/v1/completions", json=body).json()
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] == 6
    held = http.post("/v1/completions", json={**body, "min_tokens": 16}).json()
    assert held["usage"]["completion_tokens"] >= 16
    assert held["choices"][0]["text"].startswith(plain["choices"][0]["text"])
    exact = http.post("/v1/completions", json={**body, "max_tokens": 12,
                                                "min_tokens": 12}).json()
    assert exact["usage"]["completion_tokens"] == 12
    assert exact["choices"][0]["finish_reason"] == "length"


def test_ignore_eos_generates_max_tokens(http):
    body = {"model": MODEL, "prompt": EARLY_EOS, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    r = http.post("/v1/completions", json=body).json()
    assert r["usage"]["completion_tokens"] == 20 and r["choices"][0]["finish_reason"] == "length"


def test_bad_extension_values_are_400s_naming_the_field(http):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert "min_tokens" in refused(http, "/v1/chat/completions",
                                   {**chat, "max_tokens": 4, "min_tokens": 5},
                                   "min_tokens")["message"]
    refused(http, "/v1/chat/completions", {**chat, "min_tokens": -1}, "min_tokens")
    # max_tokens left to the default (1024, cut to the context left): min_tokens above it.
    refused(http, "/v1/chat/completions", {**chat, "min_tokens": 100_000}, "min_tokens")
    err = refused(http, "/v1/chat/completions",
                  {**chat, "max_tokens": 8, "min_tokens": 2,
                   "response_format": {"type": "json_object"}}, "min_tokens")
    assert err["code"] == "unsupported_parameter"
    refused(http, "/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": "5"},
            "min_tokens", status=422)
    refused(http, "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
            "stream_options.continuous_usage_stats", status=422)
    # A stream option nobody implements is still refused by name.
    refused(http, "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": {"include_usage": True,
                                                        "usage_every_ms": 5}},
            "stream_options.usage_every_ms")


_CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("path, body", [
    # GuideLLM 0.8.1 (guidellm/backends/openai/request_handlers.py), fixed output length.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two three"}],
                              "max_completion_tokens": 7, "stop": None, "ignore_eos": True,
                              "stream_options": _CONTINUOUS}),
    ("/v1/completions", {"prompt": "one two three", "max_tokens": 7, "stop": None,
                         "ignore_eos": True, "stream_options": _CONTINUOUS}),
    # vLLM's `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py), --ignore-eos.
    ("/v1/completions", {"prompt": "one two three", "repetition_penalty": 1.0, "max_tokens": 7,
                         "logprobs": None, "stream_options": {"include_usage": True},
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "one two three"}]}], "max_completion_tokens": 7,
        "stream_options": {"include_usage": True}, "ignore_eos": True}),
    # genai-perf with its documented fixed-length inputs (--extra-inputs min_tokens / ignore_eos).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two three"}],
                              "max_tokens": 7, "min_tokens": 7, "ignore_eos": True}),
    # llmperf (ray-project/llmperf openai_chat_completions_client.py): an empty system turn,
    # its sampling params merged in; it reads choices[0] of every chunk (no usage chunk).
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": ""},
                                           {"role": "user", "content": "one two three"}],
                              "max_tokens": 7, "ignore_eos": True}),
], ids=["guidellm-chat", "guidellm-completions", "vllm-bench-completions", "vllm-bench-chat",
        "genai-perf-chat", "llmperf-chat"])
def test_benchmark_client_bodies_succeed(http, path, body):
    """The bodies these clients build, streamed: each gets exactly its 7 tokens, counted in the
    usage they read (every chunk with continuous_usage_stats, the last one with include_usage)."""
    evs = events(http, path, {"model": MODEL, "stream": True, **body})
    so = body.get("stream_options", {})
    if so.get("continuous_usage_stats"):
        assert all("usage" in e for e in evs)
    if so.get("include_usage"):
        assert evs[-1]["usage"]["completion_tokens"] == 7
    text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                   for e in evs for c in e["choices"])
    finishes = [c["finish_reason"] for e in evs for c in e["choices"] if c["finish_reason"]]
    assert text and finishes == ["length"]
    if not so:
        assert all(e["choices"] for e in evs)
