"""End to end through Ray Serve's HTTP proxy with the official openai SDK as the client."""
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.fixtures.serve import TEST_API_KEY, TEST_MODEL, TEST_MODEL_INT8

MSG = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def client(orchard_url):
    return openai.OpenAI(base_url=orchard_url + "/v1", api_key=TEST_API_KEY, max_retries=0,
                         timeout=120)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [TEST_MODEL, TEST_MODEL_INT8]


def test_chat_non_streaming_usage_and_length(client):
    r = client.chat.completions.create(model=TEST_MODEL, messages=MSG, max_tokens=6,
                                       temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.id.startswith("chatcmpl-") and r.model == TEST_MODEL


def test_chat_streaming_matches_non_streaming(client):
    kw = dict(model=TEST_MODEL, messages=MSG, max_tokens=8, temperature=0.9, seed=7)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completions_streaming_and_not(client):
    kw = dict(model=TEST_MODEL, prompt="def add(a, b):", max_tokens=5, temperature=0)
    r = client.completions.create(**kw)
    assert r.object == "text_completion" and r.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == r.choices[0].text


def test_seed_reproducible_at_positive_temperature(client):
    kw = dict(model=TEST_MODEL, messages=MSG, max_tokens=12, temperature=1.0)
    a = client.chat.completions.create(**kw, seed=123).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=123).choices[0].message.content
    others = {client.chat.completions.create(**kw, seed=s).choices[0].message.content
              for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds should not all give the same text"


def test_stop_string_truncates_and_finishes_with_stop(client):
    kw = dict(model=TEST_MODEL, messages=MSG, max_tokens=24, temperature=0)
    free = client.chat.completions.create(**kw).choices[0].message.content
    assert len(free) >= 4
    stop = free[2:4]
    r = client.chat.completions.create(**kw, stop=[stop])
    expected = free[:free.index(stop)]
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"


def test_concurrent_requests(client):
    # 8 at once may exceed what the learned cap admits plus the 2-deep queue (the cap depends on
    # what earlier tests taught the actor): a refusal is a 429 with Retry-After, which the SDK
    # honours when retries are on, as a real client would. Every request must then complete.
    retrying = client.with_options(max_retries=5)

    def one(i):
        r = retrying.chat.completions.create(
            model=TEST_MODEL, messages=[{"role": "user", "content": f"count {i}"}],
            max_tokens=4 + i % 3, temperature=0)
        return r.usage.completion_tokens, 4 + i % 3

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(got == want for got, want in results)
