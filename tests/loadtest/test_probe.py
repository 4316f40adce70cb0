"""Reading a capacity feed by key names: advertised concurrency and idleness."""
from __future__ import annotations

from loadtest import probe

# Shaped like capacity.fleet.snapshot(), the feed Orchard serves at /v1/models/capacity.
FEED = {"protocol_version": 1, "outstanding_raw_tokens": 0,
        "counters": {"holds": 40, "releases": 40, "refusals": 3},
        "models": [
            {"model_id": "other", "headroom_requests": 99, "headroom_raw_tokens": 10**6},
            {"model_id": "tiny", "ready": True, "replicas": 1, "headroom_requests": 8,
             "headroom_raw_tokens": 4000, "max_request_raw_tokens": 4001,
             "identities": [{"identity": "native", "cap": 8}]}]}


def test_advertised_concurrency_takes_the_tighter_bound():
    assert probe.advertised_concurrency(FEED, "tiny", raw_tokens_per_request=250) == 8
    assert probe.advertised_concurrency(FEED, "tiny", raw_tokens_per_request=1000) == 4
    assert probe.advertised_concurrency(FEED, "other", 100) == 99
    assert probe.advertised_concurrency({"models": [{"model_id": "m", "max_concurrency": 3}]},
                                        "m", 100) == 3
    assert probe.advertised_concurrency(None, "tiny", 100) is None
    assert probe.advertised_concurrency({"models": []}, "tiny", 100) is None


def test_busy_and_headroom_fields_ignore_lifetime_counters():
    assert probe.busy_values(FEED) == {"outstanding_raw_tokens": 0.0}
    busy = {**FEED, "outstanding_raw_tokens": 300}
    assert probe.busy_values(busy) == {"outstanding_raw_tokens": 300.0}
    room = probe.headroom_values(FEED)
    # requests headroom follows learned caps, so only token headroom marks idleness
    assert room == {"models.0.headroom_raw_tokens": 10**6, "models.1.headroom_raw_tokens": 4000}


def test_context_length_from_models_list():
    models = [{"id": "a", "max_model_len": 2048}, {"id": "b", "context_length": 512}]
    assert probe.context_length(models, "b") == 512
    assert probe.context_length(models, "a") == 2048
    assert probe.context_length([{"id": "c"}], "c") is None
