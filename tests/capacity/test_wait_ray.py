"""Waiting holds end to end: CapacityClient.hold(..., wait_s=...) against a real actor, over the
direct connection and over Ray calls. Session-wide Ray (tests/fixtures/ray_session.py)."""
import asyncio
import time
import uuid

import pytest

from capacity.actor import get_or_create_actor
from serve_app.capacity_client import CapacityClient
from capacity.errors import CapacityRefused
from tests.fixtures.conditions import until

NS = "orchard-test"


def beat(seq, model, replica, max_=1000):
    return {"replica_id": replica, "node_id": replica, "chip_class": "M4|Max", "incarnation": 1,
            "seq": seq, "slots": [{"model_id": model, "state": "running", "raw_budget_used": 0,
                                  "raw_budget_max": max_, "max_concurrency": 64,
                                  "kv_bytes_per_token": 1}]}


async def connected(name, transport, beats) -> CapacityClient:
    """A client of actor `name` that has sent `beats`, over `transport` ("auto": its direct
    connection up before anything is held)."""
    client = CapacityClient(namespace=NS, name=name, snapshot_path="", call_timeout_s=30,
                            transport=transport)
    for b in beats:
        await client.heartbeat(b)
    if transport == "auto":
        await until(lambda: bool(client.fast_link.conns), what="the direct connection up")
    return client


@pytest.mark.parametrize("transport", ["auto", "ray"])
def test_client_waits_in_fifo_and_gives_up_cleanly(ray_session, transport):
    ray = ray_session
    name = f"capacity-{uuid.uuid4().hex[:8]}"
    actor = get_or_create_actor(NS, name, config={"caps": {"native_seeds": {"m": 400.0,
                                                                           "m2": 400.0}}},
                                snapshot_path="", reap_interval_s=0.05)

    async def waiting():
        return (await actor.info.remote())["waiting"]

    async def scenario():
        client = await connected(name, transport, [beat(1, "m", "r0"), beat(1, "m2", "r2")])
        assert (await client.hold("m", 1000, "a")).replica_id == "r0"
        b = asyncio.ensure_future(client.hold("m", 600, "b", wait_s=20))
        c = asyncio.ensure_future(client.hold("m", 600, "c", wait_s=20))
        await until(lambda: waiting_is(2))
        # Other traffic is not held up by the waiters.
        t0 = time.monotonic()
        for i in range(10):
            h = await client.hold("m2", 10, f"x{i}")
            assert h.replica_id == "r2" and await client.release(f"x{i}")
        assert time.monotonic() - t0 < 5.0 and not b.done()
        # Give up on "c" (the caller is cancelled): the actor forgets it, never grants it.
        c.cancel()
        await until(lambda: waiting_is(1))
        assert await client.release("a")                    # frees room for "b", first in line
        hold_b = await asyncio.wait_for(b, 10)
        assert hold_b.replica_id == "r0" and not hold_b.fallback
        snap = await client.snapshot()
        assert snap["outstanding_raw_tokens"] == 600        # "b" only, never "c"
        # A wait that runs out is today's refusal, with its Retry-After hint.
        t0 = time.monotonic()
        with pytest.raises(CapacityRefused) as e:
            await client.hold("m", 600, "d", wait_s=0.3)
        assert e.value.reason == "no_capacity" and e.value.retry_after_s > 0
        assert 0.25 <= time.monotonic() - t0 < 5.0
        assert await client.release("b")
        assert (await client.snapshot())["outstanding_raw_tokens"] == 0
        info = await actor.info.remote()
        assert info["waits"]["granted"] == 1 and info["waits"]["timed_out"] == 1
        assert info["waits"]["cancelled"] + info["waits"]["dropped"] == 1
        if transport == "auto":
            assert client.fast_batches > 0 and info["fast"]["fast_batches"] > 0
        else:
            assert client.fast_batches == 0 and info["fast"] is None
        await client.close()

    async def waiting_is(n):
        return await waiting() == n

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(actor, no_restart=True)


@pytest.mark.parametrize("transport", ["auto", "ray"])
def test_an_affine_wait_crosses_both_transports(ray_session, transport):
    """The affine field travels on both transports: the hold waits for its holder (r0) beside
    the FIFO, a plain hold meanwhile goes to r1, and the freed r0 is the affine waiter's."""
    ray = ray_session
    name = f"capacity-{uuid.uuid4().hex[:8]}"
    actor = get_or_create_actor(NS, name, config={"caps": {"native_seeds": {"m": 400.0}}},
                                snapshot_path="", reap_interval_s=0.05)

    async def parked():
        return (await actor.info.remote())["waits"]["affine_parked"] == 1

    async def scenario():
        client = await connected(name, transport, [beat(1, "m", "r0"), beat(1, "m", "r1")])
        assert (await client.hold("m", 1000, "a", exclude=["r1"])).replica_id == "r0"
        b = asyncio.ensure_future(client.hold("m", 600, "b", exclude=["r1"], wait_s=20,
                                              affine=True))
        await until(parked, what="the affine hold parked")
        assert (await client.hold("m", 600, "c", wait_s=20)).replica_id == "r1"
        assert not b.done() and await client.release("a")
        assert (await asyncio.wait_for(b, 10)).replica_id == "r0"
        with pytest.raises(CapacityRefused) as e:
            await client.hold("m", 600, "d", exclude=["r1"], wait_s=0.2, affine=True)
        assert e.value.reason == "no_capacity"
        info = await actor.info.remote()
        assert info["waits"]["affine_granted"] == 1 and info["waits"]["affine_timed_out"] == 1
        assert (client.fast_batches > 0) == (transport == "auto")
        await client.close()

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(actor, no_restart=True)
