"""The capacity router: every request holds in the actor and releases with telemetry; killing
the actor (a real fault) degrades routing to power-of-two choices without failing requests,
and routing through the actor resumes once a new actor has heard the replicas' heartbeats."""
import re
import time

import httpx
import pytest

from tests.fixtures.serve import TEST_API_KEY, TEST_MODEL

AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}


@pytest.fixture(scope="module")
def http(orchard_url):
    with httpx.Client(base_url=orchard_url, timeout=120) as c:
        yield c


def chat(http, max_tokens=3) -> httpx.Response:
    return http.post("/v1/chat/completions", headers=AUTH, json={
        "model": TEST_MODEL, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": "route me"}]})


def counters(http) -> dict:
    r = http.get("/v1/models/capacity", headers=AUTH)
    return r.json()["counters"] if r.status_code == 200 else {}


def router_events(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {k: float(v) for k, v in
            re.findall(r'^orchard:router_events\{event="(\w+)"\} (\S+)$', text, re.M)}


def test_each_request_holds_and_releases_through_the_actor(http):
    before = counters(http)
    for _ in range(3):
        r = chat(http)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = counters(http)
        if after["releases"] - before["releases"] >= 3:
            break
        time.sleep(0.2)
    assert after["holds"] - before["holds"] == 3
    assert after["releases"] - before["releases"] == 3
    assert router_events(http)["holds"] >= 3


def test_actor_killed_requests_still_served_then_actor_routing_resumes(http, orchard_config):
    import ray

    events0 = router_events(http)
    ray.kill(ray.get_actor("capacity", namespace=orchard_config["capacity"]["namespace"]))
    statuses = [chat(http).status_code for _ in range(8)]
    assert statuses == [200] * 8
    events1 = router_events(http)
    assert events1["faults"] > events0.get("faults", 0)
    assert events1["fallback_routes"] > events0.get("fallback_routes", 0)
    # The clients recreate the actor; once replicas heartbeat to it, holds go through it again.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert chat(http).status_code == 200
        if counters(http).get("holds", 0) > 0 and router_events(http)["holds"] > events1["holds"]:
            break
        time.sleep(0.3)
    else:
        pytest.fail("routing through the recreated actor did not resume")
