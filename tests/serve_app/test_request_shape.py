"""One request shape from the ingress to the engine: the ingress builds the engine's
GenerationRequest (with its SamplingParams) once, the GenerateCall carries it across Ray
(pickled) unchanged, and each value's range is enforced in one place, params.py, with the 400
the HTTP layer always gave. The reply is the engine's own Delta inside a ReplicaDelta."""
import pickle
import subprocess
import sys
import time

import pytest

from engine.request import Delta, GenerationRequest, Usage
from engine.sampling.params import SamplingParams, TokenLogprob
from serve_app import protocol as P
from serve_app.calls import GenerateCall
from serve_app.errors import APIError
from serve_app.wire import ReplicaDelta

MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, **fields})


def test_a_call_round_trips_through_pickle_with_its_params():
    req = _chat(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["\n\n"], min_tokens=2,
                min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
                repetition_penalty=1.1, logit_bias={"7": -3}, stop_token_ids=[2],
                logprobs=True, top_logprobs=3, ignore_eos=True)
    call = GenerateCall(GenerationRequest("r-1", [1, 2, 3], req.sampling_params(8, None),
                                          tenant="key-ab"),
                        "m", first_token_deadline_unix=123.5, trace={"ingress_in": 1.0})
    back = pickle.loads(pickle.dumps(call))
    assert back == call and back.request == call.request
    assert back.request.params == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=8, stop=("\n\n",),
        ignore_eos=True, min_tokens=2, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias=((7, -3.0),),
        stop_token_ids=(2,), logprobs=3)
    assert back.raw_tokens == 3 + 8


def test_fields_left_out_take_the_engine_defaults():
    assert _chat().sampling_params(4, None) == SamplingParams(max_tokens=4)


# (fields, param, the 400 message the ingress gave before ranges moved to params.py)
RANGES = [
    (dict(max_tokens=0), "max_tokens", "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", "min_tokens must be in [0, 4], got 5"),
    (dict(temperature=2.5), "temperature", "temperature must be in [0, 2], got 2.5"),
    (dict(top_p=0.0), "top_p", "top_p must be in (0, 1], got 0.0"),
    (dict(top_k=-1), "top_k", "top_k must be >= 0, got -1"),
    (dict(min_p=1.5), "min_p", "min_p must be in [0, 1], got 1.5"),
    (dict(presence_penalty=3), "presence_penalty", "presence_penalty must be in [-2, 2], got 3.0"),
    (dict(frequency_penalty=-2.5), "frequency_penalty",
     "frequency_penalty must be in [-2, 2], got -2.5"),
    (dict(repetition_penalty=0), "repetition_penalty",
     "repetition_penalty must be in (0, 10], got 0.0"),
    (dict(logit_bias={"5": 101}), "logit_bias",
     "logit_bias values must be in [-100, 100], got 101.0"),
    (dict(stop_token_ids=[-3]), "stop_token_ids", "stop_token_ids must be token ids >= 0"),
]


@pytest.mark.parametrize("fields, param, message", RANGES, ids=[r[1] for r in RANGES])
def test_each_range_is_enforced_once_in_params(fields, param, message):
    req = _chat(**fields)
    P.check_values(req)   # the HTTP layer leaves ranges to the field's declaration
    asked = req.requested_max_tokens()
    with pytest.raises(APIError) as e:
        req.sampling_params(16 if asked is None else asked, None)
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)


@pytest.mark.parametrize("fields, param", [
    (dict(n=9), "n"), (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logprobs=True, top_logprobs=21),
                                                 "top_logprobs")])
def test_openai_only_rules_stay_at_http(fields, param):
    with pytest.raises(APIError) as e:
        P.check_values(_chat(**fields))
    assert e.value.param == param


def test_the_replica_hands_the_request_through_with_its_own_clock():
    req = GenerationRequest("r-2", [4, 5], SamplingParams(max_tokens=3), tenant="t")
    assert GenerateCall(req, "m").engine_request() is req
    late = GenerateCall(req, "m", first_token_deadline_unix=time.time() + 5.0).engine_request()
    assert late.first_token_deadline is not None
    assert 4.0 < late.first_token_deadline - time.monotonic() <= 5.0
    assert (late.request_id, late.prompt_ids, late.params, late.tenant) == (
        req.request_id, req.prompt_ids, req.params, req.tenant)


def test_a_reply_carries_the_engine_delta_through_pickle():
    d = Delta("r-1", "hi", [7, 8], "length", Usage(3, 2, 1), ttft_s=0.25,
              logprobs=[TokenLogprob(-0.5, ((7, -0.5), (9, -1.5))), TokenLogprob(-0.1)])
    back = pickle.loads(pickle.dumps(ReplicaDelta(d, "replica-a", {"ingress_in": 1.0})))
    assert back.delta == d and back.replica_id == "replica-a"
    entries = P.LogprobsFormatter(_Pieces()).chat(d.token_ids, back.delta.logprobs)
    assert [e["logprob"] for e in entries] == [-0.5, -0.1]
    assert [a["token"] for a in entries[0]["top_logprobs"]] == ["<7>", "<9>"]


class _Pieces:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def test_the_ingress_shape_imports_no_mlx():
    code = ("import sys, serve_app.calls, serve_app.protocol, serve_app.wire, engine.request; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'mlx'], 'mlx imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
