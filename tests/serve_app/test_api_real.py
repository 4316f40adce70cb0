"""The OpenAI surface on the real model (SmolLM2-135M-Instruct) through the official openai SDK:
served logprobs are the model's own (over a completion they sum to the sequence's
log-likelihood computed independently with mlx-lm on the same weights), and json_schema output
validates against its schema for 50 sampled requests."""
import json
import math
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.api_server import served

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def folder():
    from engine.model.gguf.real_model import ensure_real_model

    return str(ensure_real_model())


@pytest.fixture(scope="module")
def client(folder):
    with served([{"id": "smollm2", "path": folder, "max_num_seqs": 16, "warmup": False}]) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.mark.real
def test_logprobs_sum_to_the_sequence_log_likelihood(folder, client):
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(folder)
    prompt_ids = tok.encode(PROMPT)
    gen = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=12,
                                            sampler=make_sampler(0.0))]
    logits = model(mx.array([prompt_ids + gen]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = [logp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(gen)]
    del model
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8, temperature=0.9, seed=5, logprobs=True, top_logprobs=2)
    got = r.choices[0].logprobs.token_logprobs
    assert r.choices[0].text == tok.decode(gen)
    assert len(got) == len(want) == 12
    assert all(math.isclose(g, w, abs_tol=2e-3) for g, w in zip(got, want)), (got, want)
    assert math.isclose(sum(got), sum(want), abs_tol=1e-2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                "maxItems": 3},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "hobbies", "employed"], "additionalProperties": False}


@pytest.mark.real
def test_json_schema_outputs_validate_for_50_sampled_requests(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}

    def one(seed):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content":
                                        "Invent a person and describe them in JSON."}],
            max_tokens=120, temperature=1.0, seed=seed, response_format=fmt)
        return r.choices[0].finish_reason, r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(50)))
    for finish, text in outs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for _, text in outs}) > 25   # sampled, not one forced answer
