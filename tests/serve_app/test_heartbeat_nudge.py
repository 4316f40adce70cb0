"""A replica's release calls for a heartbeat at once (CapacityLink.nudge), so a hold queued behind
its full replica is granted when the replica's requests end, not at the next heartbeat interval.

Real capacity actor on the session's Ray; the replica is a stand-in reporter (the link's
ReplicaReporter protocol) whose engine state the test sets: one slot (max_concurrency 1), busy
with request "a" until it ends. The interval is an hour, so only a nudge can free the slot.
"""
import asyncio
import uuid

import pytest

from capacity.actor import DEFAULT_NAME
from capacity.protocol import RequestTelemetry
from serve_app.capacity_link import CapacityLink
from serve_app.config import CapacitySettings
from tests.fixtures.conditions import until

pytestmark = pytest.mark.ray


class OneSlotReplica:
    """What a ModelServer reports, reduced to the facts the test moves: its running requests."""

    replica_id = "r0"
    model_id = "m"

    def __init__(self):
        self.active: dict[str, int] = {}

    def active_raw_tokens(self) -> dict[str, int]:
        return dict(self.active)

    def heartbeat_report(self, incarnation: int, seq: int) -> dict:
        n = len(self.active)
        return {"replica_id": self.replica_id, "node_id": "n0", "chip_class": "M4|Max",
                "incarnation": incarnation, "seq": seq,
                "slots": [{"model_id": self.model_id, "state": "running" if n else "idle",
                           "num_running": n, "num_waiting": 0,
                           "raw_budget_used": sum(self.active.values()),
                           "raw_budget_max": 10_000, "max_concurrency": 1,
                           "kv_bytes_per_token": 1,
                           "active": [{"request_id": r, "raw_tokens": t}
                                      for r, t in self.active.items()]}]}


def test_a_release_frees_the_slot_for_a_queued_hold_without_waiting_for_the_interval(
        ray_session):
    settings = CapacitySettings(namespace=f"nudge-{uuid.uuid4().hex[:8]}", snapshot_path="",
                                heartbeat_interval_s=3600.0)

    async def scenario():
        replica = OneSlotReplica()
        link = CapacityLink(settings, replica)
        await link.start()                        # the replica is known, idle
        router = link.client                      # an ingress holds through the same actor
        actor = ray_session.get_actor(DEFAULT_NAME, namespace=settings.namespace)
        assert (await router.hold("m", 100, "a")).replica_id == "r0"
        replica.active["a"] = 100
        assert await link.commit("a")
        await link.beat()                         # the actor now sees its one slot busy
        queued = asyncio.ensure_future(router.hold("m", 100, "b", wait_s=30))

        async def parked_or_answered():
            return queued.done() or (await actor.info.remote())["waiting"] >= 1

        await until(parked_or_answered, 20, "b parked at the actor")
        assert not queued.done(), "b should wait: the replica's only slot runs a"
        beats = link.heartbeats_sent
        del replica.active["a"]                   # "a" ends on the replica
        link.release_soon("a", RequestTelemetry(prompt_tokens=10, completion_tokens=5))
        # Without the nudge, b waits for the hour-long interval, then is refused at 30 s.
        hold = await asyncio.wait_for(queued, 20)
        assert hold.replica_id == "r0" and not hold.fallback
        assert link.heartbeats_sent > beats
        link.stop()

    asyncio.run(scenario())
