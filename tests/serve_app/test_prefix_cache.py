"""Served replicas reuse an earlier prompt's KV pages by default: a chat's next turn resends
its history, and only the new tokens are prefilled (the OpenAI usage reports the rest as
cached_tokens). Through the deployed app with the openai SDK, for native and int8 KV."""
import openai
import pytest

from tests.fixtures.serve import TEST_API_KEY, TEST_API_KEY_OTHER, TEST_MODEL, TEST_MODEL_INT8

HISTORY = " ".join(f"item {i} is a {w}" for i, w in enumerate(["cat", "dog", "fox", "owl"] * 12))


@pytest.fixture(scope="module")
def client(orchard_url):
    return openai.OpenAI(base_url=orchard_url + "/v1", api_key=TEST_API_KEY, max_retries=3,
                         timeout=120)


@pytest.mark.parametrize("model", [TEST_MODEL, TEST_MODEL_INT8])
def test_next_turn_prefills_only_what_is_new(client, model):
    first = [{"role": "user", "content": f"[{model}] Remember this list: {HISTORY}"}]
    r1 = client.chat.completions.create(model=model, messages=first, max_tokens=4,
                                        temperature=0)
    assert r1.usage.prompt_tokens > 100
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "Which item is the first owl?"}]
    r2 = client.chat.completions.create(model=model, messages=second, max_tokens=4,
                                        temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # Whole pages of the shared history come from the cache; what is recomputed is the page
    # where the two renderings part (the first turn's generation prompt) and the new tail.
    assert cached >= r1.usage.prompt_tokens - 64, (cached, r1.usage.prompt_tokens)
    assert cached < r2.usage.prompt_tokens


def test_another_api_key_does_not_share_the_cache(client, orchard_url):
    other = openai.OpenAI(base_url=orchard_url + "/v1", api_key=TEST_API_KEY_OTHER,
                          max_retries=3, timeout=120)
    msg = [{"role": "user", "content": f"[tenants] Remember this list: {HISTORY}"}]
    kw = dict(model=TEST_MODEL, messages=msg, max_tokens=2, temperature=0)
    client.chat.completions.create(**kw)
    same_key = client.chat.completions.create(**kw).usage
    assert same_key.prompt_tokens_details.cached_tokens >= same_key.prompt_tokens - 64  # page
    other_key = other.chat.completions.create(**kw).usage
    assert other_key.prompt_tokens_details.cached_tokens == 0
