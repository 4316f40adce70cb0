"""The OpenAI surface over real HTTP (tests/api_server.py) on orchard-tiny, driven by the
official openai SDK: every field is implemented, refused with a 400 naming it, or on the short
ignored list; errors are OpenAI-shaped JSON; max_tokens defaults and 413s are decided at once."""
import json

import httpx
import openai
import pytest

from tests.api_server import TINY, served, tiny_with_template

MSG = [{"role": "user", "content": "hello"}]
KV_TOKENS = 256           # tiny-kv's KV budget, in tokens (float32 K/V on the CPU)
BYTES_PER_TOKEN = 6 * 2 * 64 * 2 * 4   # orchard-tiny: layers x KV heads x head dim x (K,V) x 4
DEFAULT_MAX_TOKENS = 5


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # The same weights behind a chat template that raises for system messages: a real template
    # error, as strict templates (Mistral, Gemma) raise for unsupported roles.
    strict = tiny_with_template(tmp_path_factory.mktemp("strict"), lambda old: (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception("
        "'System role not supported') }}{% endif %}" + old))
    small = {"max_num_seqs": 2, "warmup": False}
    with served([{"id": "tiny", "path": TINY, "max_num_seqs": 4, "warmup": False},
                 {"id": "tiny-ctx", "path": TINY, "engine": {"max_model_len": 48}, **small},
                 {"id": "tiny-kv", "path": TINY, "kv_budget_bytes": KV_TOKENS * BYTES_PER_TOKEN,
                  **small},
                 {"id": "tiny-strict", "path": str(strict), **small},
                 {"id": "tiny-nocache", "path": TINY,
                  "engine": {"enable_prefix_caching": False}, **small}],
                http={"default_max_tokens": DEFAULT_MAX_TOKENS,
                      "cors_origins": ["https://app.example"]}) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _refused(call, param: str, code: str, status=openai.BadRequestError):
    with pytest.raises(status) as e:
        call()
    err = e.value.body
    assert err["param"] == param and err["code"] == code, err
    assert param.split(".")[-1].split("[")[0] in err["message"] or code != "unknown_parameter"
    return err


@pytest.mark.parametrize("extra, param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
], ids=["top-level", "nested"])
def test_unknown_fields_are_refused_naming_them(client, extra, param):
    _refused(lambda: client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2,
                                                    extra_body=extra), param, "unknown_parameter")


def test_unknown_message_field_is_refused(client):
    msgs = [{"role": "user", "content": "hi", "colour": "blue"}]
    _refused(lambda: client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2),
             "messages[0].colour", "unknown_parameter")


UNSERVED = [
    ("tools", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
    ("response_format", dict(response_format={"type": "yaml"})),
    ("tool_choice", dict(tool_choice="required")),
    ("modalities", dict(modalities=["text", "audio"])),
]


@pytest.mark.parametrize("param, kw", UNSERVED, ids=[u[0] for u in UNSERVED])
def test_unserved_features_are_refused_not_dropped(client, param, kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_image_parts_and_tool_call_history_are_refused(client):
    img = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                        {"type": "image_url",
                                         "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    _refused(lambda: client.chat.completions.create(model="tiny", messages=img, max_tokens=2),
             "messages[0].content[1].type", "unsupported_parameter")
    hist = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    _refused(lambda: client.chat.completions.create(model="tiny", messages=hist, max_tokens=2),
             "messages[1].tool_calls", "unsupported_parameter")


def test_neutral_and_ignored_fields_are_accepted(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}],
                                 "name": "ann"}],
        max_tokens=2, tools=[], tool_choice="none", response_format={"type": "text"},
        user="u1", metadata={"k": "v"}, store=False, service_tier="auto", temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_completion_refusals(client):
    _refused(lambda: client.completions.create(model="tiny", prompt="a", max_tokens=2,
                                               suffix="b"), "suffix", "unsupported_parameter")
    _refused(lambda: client.completions.create(model="tiny", prompt="a", max_tokens=2,
                                               best_of=3), "best_of", "unsupported_parameter")
    _refused(lambda: client.completions.create(model="tiny", prompt="a", max_tokens=2,
                                               echo=True, logprobs=1),
             "echo", "unsupported_parameter")


def test_value_errors_name_the_field(client):
    for kw, param in [(dict(presence_penalty=3), "presence_penalty"),
                      (dict(frequency_penalty=-2.5), "frequency_penalty"),
                      (dict(extra_body={"min_p": 1.5}), "min_p"), (dict(n=9), "n"),
                      (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                      (dict(top_logprobs=2), "top_logprobs"),
                      (dict(logit_bias={"5": 101}), "logit_bias"),
                      (dict(logit_bias={"x": 1}), "logit_bias"),
                      (dict(logit_bias={"8192": 1}), "logit_bias"),
                      (dict(extra_body={"stop_token_ids": [99999]}), "stop_token_ids"),
                      (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty")]:
        _refused(lambda: client.chat.completions.create(model="tiny", messages=MSG,
                                                        max_tokens=2, **kw),
                 param, "invalid_value")


def test_chat_template_error_is_a_json_400(client, url):
    sys_msg = [{"role": "system", "content": "be brief"}, *MSG]
    err = _refused(lambda: client.chat.completions.create(model="tiny-strict", messages=sys_msg,
                                                          max_tokens=2),
                   "messages", "invalid_messages")
    assert "System role not supported" in err["message"]
    # The same model still serves messages its template accepts.
    r = client.chat.completions.create(model="tiny-strict", messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_model_card_and_unknown_route_are_json(client, url):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    r = httpx.post(url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_omitted_max_tokens_takes_the_configured_default(client):
    r = client.completions.create(model="tiny", prompt="def f(x):", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == DEFAULT_MAX_TOKENS


def test_omitted_max_tokens_never_exceeds_the_context_left(client):
    # tiny-ctx holds 48 tokens: a 45-token prompt leaves 3, below the default of 5.
    prompt = list(range(100, 145))
    r = client.completions.create(model="tiny-ctx", prompt=prompt, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 45 and r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_requests_that_can_never_fit_get_413_with_the_numbers(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny-ctx", prompt=list(range(100, 145)), max_tokens=4)
    assert e.value.status_code == 413
    assert e.value.body["code"] == "context_length_exceeded" and "48" in e.value.body["message"]
    # Fits tiny-kv's 4096-token context but never its KV budget: refused by the ingress
    # before any queue (its message names the budget in tokens).
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny-kv", prompt="x", max_tokens=2000)
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
    msg = e.value.body["message"]
    assert "max_tokens=2000" in msg and "KV budget" in msg
    budget = int(msg.split("exceeds the ")[1].split(" tokens")[0])
    assert 0 < budget <= KV_TOKENS
    # A request within that budget is served.
    ok = client.completions.create(model="tiny-kv", prompt="x", max_tokens=budget - 4,
                                   temperature=0, stop=["\n"])
    assert ok.usage.completion_tokens >= 1


def test_n_choices_seeded_distinct_and_streamed(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x ="}], max_tokens=6,
              temperature=2.0, seed=11, n=3)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1
    assert r.usage.completion_tokens == sum(
        client.chat.completions.create(**{**kw, "n": 1, "seed": 11 + i}).usage.completion_tokens
        for i in range(3))
    # Choice i is the request seeded seed + i, streamed or not.
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks
                        if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    finishes = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finishes == [0, 1, 2]


def test_echo_prepends_the_prompt(client):
    kw = dict(model="tiny", prompt="def add(a, b):", max_tokens=4, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(**kw, echo=True).choices[0].text
    assert echoed == "def add(a, b):" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **kw, echo=True, stream=True) if c.choices)
    assert streamed == echoed


def test_chat_logprobs_streamed_equal_full_and_greedy_is_top1(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x ="}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert [a.logprob for a in e.top_logprobs] == sorted(
            (a.logprob for a in e.top_logprobs), reverse=True)
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_completion_logprobs_shape(client):
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=5,
                                  temperature=0.8, seed=4, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    streamed = [v for c in client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=5, temperature=0.8, seed=4, logprobs=2,
        stream=True, extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs
        for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def _pieces(client, **kw):
    r = client.completions.create(model="tiny", prompt="def f(x):", logprobs=0, **kw)
    return r, r.choices[0].logprobs.tokens


def test_logit_bias_and_stop_token_ids(client):
    forced = 300
    r, pieces = _pieces(client, max_tokens=4, temperature=1.0, seed=2,
                        logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert len(set(pieces)) == 1 and len(pieces) == 4
    r, pieces = _pieces(client, max_tokens=4, temperature=0, logit_bias={str(forced): 100},
                        extra_body={"stop_token_ids": [forced]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].text == ""


@pytest.mark.parametrize("penalty", [dict(frequency_penalty=1.5), dict(presence_penalty=1.5)],
                         ids=["frequency", "presence"])
def test_penalties_pick_as_specified(client, penalty):
    """Greedy with a penalty picks, at every step, the token maximizing the model's logprob
    minus the penalty on what was generated so far (checked over the top-20 alternatives)."""
    kw = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    base, base_pieces = _pieces(client, **kw)
    r = client.completions.create(model="tiny", prompt="def f(x):", logprobs=20, **kw, **penalty)
    lp = r.choices[0].logprobs
    assert lp.tokens != base_pieces, "the penalty changed nothing"
    f, p = penalty.get("frequency_penalty", 0), penalty.get("presence_penalty", 0)
    counts: dict[str, int] = {}
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        def score(piece, logprob):
            c = counts.get(piece, 0)
            return logprob - f * c - (p if c else 0)
        best = max(score(a, v) for a, v in top.items())
        assert score(tok, chosen) >= best - 1e-4
        counts[tok] = counts.get(tok, 0) + 1
    zero = client.completions.create(model="tiny", prompt="def f(x):", logprobs=0, **kw,
                                     frequency_penalty=0, presence_penalty=0)
    assert zero.choices[0].text == base.choices[0].text


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "size": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["a", "b"]}}, "required": ["name", "size", "kind"],
    "additionalProperties": False}


def test_json_schema_output_matches_the_schema(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                  "strict": True}}
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "Describe a thing as JSON."}], max_tokens=60,
            temperature=1.0, seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # Streamed, the deltas join to the same document.
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=60,
              temperature=0, response_format=fmt)
    full = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **kw, stream=True) if c.choices)
    assert streamed == full and json.loads(full)["kind"] in ("a", "b")


def test_json_object_output_is_an_object(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a dict"}},
    {"type": "json_object", "schema": {}},
], ids=["bad-type", "schema-not-object", "extra-key"])
def test_bad_response_format_is_refused(client, fmt):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4,
                                       response_format=fmt)
    assert e.value.body["param"] == "response_format", e.value.body


def test_cors_allows_the_configured_origin_only(url):
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(url + "/v1/chat/completions",
                       headers={"Origin": "https://app.example", **pre})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(url + "/v1/chat/completions",
                          headers={"Origin": "https://evil.example", **pre})
    assert "access-control-allow-origin" not in other.headers


def test_n_choices_share_the_prompt_pages_through_the_prefix_cache(client):
    from engine.kv.pages import DEFAULT_PAGE_TOKENS

    prompt = list(range(300, 300 + 2 * DEFAULT_PAGE_TOKENS + 5))   # 2 full pages and a tail
    kw = dict(prompt=prompt, max_tokens=3, temperature=1.0, seed=1, n=3)
    r = client.completions.create(model="tiny", **kw)   # served models cache prefixes
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens_details.cached_tokens == 2 * DEFAULT_PAGE_TOKENS
    # Without the cache every choice writes the prompt's KV itself.
    assert client.completions.create(model="tiny-nocache", **kw).usage.prompt_tokens_details \
        .cached_tokens == 0
