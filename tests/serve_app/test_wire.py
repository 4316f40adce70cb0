"""Replica items as they cross Ray (serve_app/wire.py): bytes both ends agree on.

What they pin: every item kind comes back equal from its bytes (the ingress reads exactly what
the replica yielded, first-delta facts included), and the Serve deployment exposes the bytes
stream under the method name the ingress's RayBackend calls."""
from __future__ import annotations

import pytest

from engine.request import Delta, Usage
from serve_app.wire import ReplicaDelta, ReplicaError, decode, encode

pytestmark = pytest.mark.unit


def test_items_round_trip_through_their_bytes():
    first = ReplicaDelta(Delta("r1", " hello", [11, 12], None, Usage(5, 2), ttft_s=0.03),
                         replica_id="replica-a", trace={"replica_in": 1.5})
    last = ReplicaDelta(Delta("r1", "!", [13], "stop", Usage(5, 3)))
    error = ReplicaError({"status": 503, "message": "no capacity", "code": "no_capacity"})
    for item in (first, last, error):
        data = encode(item)
        assert isinstance(data, bytes)
        assert decode(data) == item


def test_the_ingress_calls_the_deployments_bytes_stream():
    from serve_app.app import ModelDeployment
    from serve_app.backends import RayBackend

    class Handle:   # records what RayBackend configures; Serve itself is exercised elsewhere
        def __init__(self):
            self.methods = []

        def options(self, **kw):
            self.methods.append(kw.get("method_name"))
            return self

    handle = Handle()
    RayBackend(handle)
    streamed = [m for m in handle.methods if m != "info"]
    assert streamed == ["generate_wire"] and hasattr(ModelDeployment, "generate_wire")
