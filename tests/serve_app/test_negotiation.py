"""A replica configured for a packed KV format confirms it with the capacity actor before it
becomes ready: it keeps asking while the actor does not answer, and refuses (never native)
when the actor cannot keep per-format histories.

FAKE: an actor that stays unreachable for a while cannot be caused for real here (the client
creates the actor when it is missing), so the client's `info()` is replaced by one that answers
None (unreachable) twice, then a real ActorInfo. The retry waits are shortened for the test."""
import asyncio
import logging

import pytest

from capacity.errors import ProtocolError
from capacity.protocol import ActorInfo
from serve_app import capacity_link
from serve_app.config import CapacitySettings


class FlakyClient:
    def __init__(self, answers):
        self.answers = list(answers)
        self.asked = 0

    async def info(self):
        self.asked += 1
        return self.answers.pop(0)


def negotiate(monkeypatch, client, fmt="int4"):
    monkeypatch.setattr(capacity_link, "make_client", lambda settings: client)
    monkeypatch.setattr(capacity_link, "NEGOTIATION_RETRY_S", (0.001,))
    return asyncio.run(capacity_link.negotiate_format(fmt, CapacitySettings(namespace="x")))


def test_packed_format_waits_for_the_actor_and_logs_why(monkeypatch, caplog):
    client = FlakyClient([None, None, ActorInfo()])
    with caplog.at_level(logging.WARNING, logger="orchard.capacity_link"):
        fmt, why = negotiate(monkeypatch, client)
    assert fmt == "int4" and client.asked == 3
    retries = [r.getMessage() for r in caplog.records if "not ready" in r.getMessage()]
    assert len(retries) == 2 and "capacity actor unreachable" in retries[0]


def test_an_actor_without_per_format_histories_is_refused_never_native(monkeypatch):
    old = ActorInfo(capabilities=["cost_model"])
    with pytest.raises(ProtocolError, match="refusing KV format 'int4'"):
        negotiate(monkeypatch, FlakyClient([old]))
    with pytest.raises(ProtocolError, match="no capacity settings"):
        asyncio.run(capacity_link.negotiate_format("k8v4", None))
    assert asyncio.run(capacity_link.negotiate_format("native", None))[0] == "native"
