"""A model served with int8 KV next to the same model native: its own deployment, its own
execution identity in the capacity feed and in metric labels (rates never mix formats)."""
import re

import httpx
import pytest

from tests.fixtures.serve import TEST_API_KEY, TEST_MODEL, TEST_MODEL_INT8

AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}
INT8_EXECUTION = "kvq-v1:affine-v1-k8v8-g64-f32-h64-s1:prefill=direct"


@pytest.fixture(scope="module")
def http(orchard_url):
    with httpx.Client(base_url=orchard_url, timeout=120) as c:
        yield c


def chat(http, model, stream=False) -> httpx.Response:
    return http.post("/v1/chat/completions", headers=AUTH, json={
        "model": model, "max_tokens": 5, "temperature": 0, "stream": stream, "ignore_eos": True,
        "messages": [{"role": "user", "content": "The quick brown fox"}]})


def test_int8_model_serves_on_its_own_replica(http):
    native, int8 = chat(http, TEST_MODEL), chat(http, TEST_MODEL_INT8)
    assert native.status_code == 200 and int8.status_code == 200, int8.text
    assert int8.json()["usage"]["completion_tokens"] == 5
    assert int8.headers["x-orchard-replica"] != native.headers["x-orchard-replica"]
    streamed = chat(http, TEST_MODEL_INT8, stream=True)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_feed_and_metrics_keep_identities_apart(http):
    chat(http, TEST_MODEL_INT8)
    models = {m["model_id"]: m for m in http.get("/v1/models/capacity", headers=AUTH)
              .json()["models"]}
    assert [i["identity"] for i in models[TEST_MODEL]["identities"]] == ["native"]
    [ident] = models[TEST_MODEL_INT8]["identities"]
    assert ident["identity"] == INT8_EXECUTION
    # A packed identity never borrows native rates: uncalibrated until it has its own samples.
    assert ident["cap_source"] in ("uncalibrated", "solo")
    text = http.get("/metrics").text
    assert re.search(r'vllm:time_to_first_token_seconds_count\{format_identity='
                     r'"affine-v1-k8v8-g64-f32-h64-s1",model_name="tiny-int8"\} [1-9]', text)
    assert re.search(r'orchard:concurrency_cap\{execution_identity="kvq-v1:affine-v1-k8v8[^"]*",'
                     r'model_name="tiny-int8"\}', text)


def test_release_telemetry_trains_the_packed_identity(http):
    """Released requests carry the wire execution identity, so their samples land under the
    int8 identity (a bare format identity would be quarantined and its samples dropped)."""
    import time

    for _ in range(2):
        assert chat(http, TEST_MODEL_INT8).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        models = {m["model_id"]: m for m in http.get("/v1/models/capacity", headers=AUTH)
                  .json()["models"]}
        [ident] = models[TEST_MODEL_INT8]["identities"]
        if ident["prefill_tps"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert ident["identity"] == INT8_EXECUTION
    assert ident["prefill_tps"] is not None and ident["prefill_tps"] > 0
