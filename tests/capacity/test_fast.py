"""The direct hot-path transport (capacity/transport/fastpath.py) against a real capacity actor:
batches go over it once discovered; a bad token or a garbage frame closes only that connection;
killing the actor mid-stream falls back to Ray calls, then reconnects to the restarted actor (new
port, new token) and reservations come back from heartbeats as before. Session-wide Ray
(tests/fixtures/ray_session.py)."""
import asyncio
import logging
import socket
import time
import uuid

import pytest

from capacity.actor import get_or_create_actor
from capacity.protocol import RequestTelemetry
from serve_app.capacity_client import CapacityClient
from capacity.transport.fast_link import FastLink
from capacity.transport.fastpath import FastConnection, FastFailed, encode

NS = "orchard-test"


def beat(seq, *, max_=10_000, active=(), incarnation=1):
    return {"replica_id": "r0", "node_id": "box", "chip_class": "M4|Max", "incarnation": incarnation,
            "seq": seq, "slots": [{
                "model_id": "m", "state": "running", "num_running": len(active),
                "raw_budget_used": sum(t for _, t in active), "raw_budget_max": max_,
                "max_concurrency": 64, "kv_bytes_per_token": 1,
                "active": [{"request_id": r, "raw_tokens": t} for r, t in active]}]}


def make_actor(**kw):
    name = f"capacity-{uuid.uuid4().hex[:8]}"
    actor = get_or_create_actor(NS, name, config={"caps": {"native_seeds": {"m": 400.0}}},
                                snapshot_path="", reap_interval_s=0.05, **kw)
    return name, actor


async def until_fast(client, seq0=100, timeout_s=20.0):
    """Heartbeat until the client's batches go over the direct connection."""
    deadline = time.monotonic() + timeout_s
    seq = seq0
    before = client.fast_batches
    while client.fast_batches == before:
        assert time.monotonic() < deadline, "the client never switched to the direct connection"
        seq += 1
        await client.heartbeat(beat(seq))
        await asyncio.sleep(0.02)
    return seq


@pytest.fixture
def actor_name(ray_session):
    name, actor = make_actor()
    yield name, actor
    ray_session.kill(actor, no_restart=True)


def test_hold_commit_release_over_the_direct_connection(actor_name):
    name, actor = actor_name

    async def scenario():
        client = CapacityClient(namespace=NS, name=name, snapshot_path="", call_timeout_s=30)
        await until_fast(client)
        before = await actor.info.remote()
        ray_before = client.ray_batches
        hold = await client.hold("m", 300, "a")
        assert hold.replica_id == "r0" and hold.ranking == ["r0"] and not hold.fallback
        assert await client.commit("a", "r0")
        assert (await client.snapshot())["outstanding_raw_tokens"] == 300
        assert await client.release("a", RequestTelemetry(prompt_tokens=10, batch_size=1))
        assert not await client.release("a")                      # idempotent, as over Ray
        holds = await asyncio.gather(*(client.hold("m", 10, f"c{i}") for i in range(40)))
        assert all(await asyncio.gather(*(client.release(h.request_id) for h in holds)))
        assert (await client.snapshot())["outstanding_raw_tokens"] == 0
        after = await actor.info.remote()
        assert client.ray_batches == ray_before                   # nothing fell back to Ray
        sent = after["fast"]["fast_batches"] - before["fast"]["fast_batches"]
        assert 4 <= sent <= client.fast_batches
        assert after["fast"]["fast_ops"] - before["fast"]["fast_ops"] == 4 + 80
        await client.close()

    asyncio.run(scenario())


def test_bad_token_and_garbage_close_only_that_connection(actor_name):
    name, actor = actor_name

    async def scenario():
        client = CapacityClient(namespace=NS, name=name, snapshot_path="", call_timeout_s=30)
        await until_fast(client)
        conn = next(iter(client.fast_link.conns.values()))
        ep = await actor.endpoint.remote()
        with pytest.raises(FastFailed, match="refused"):
            await FastConnection.open(ep["host"], ep["port"], "not-the-token", 5.0)

        async def raw(frames: list[bytes]) -> bytes:
            reader, writer = await asyncio.open_connection(ep["host"], ep["port"])
            for f in frames:
                writer.write(f)
            data = await asyncio.wait_for(reader.read(), 10.0)      # until the actor closes
            writer.close()
            return data

        hello = encode({"token": ep["token"], "v": 1})
        garbage = b"\x00\x00\x00\x05" + b"\xc1" * 5                 # 0xc1 is never msgpack
        # Authenticated, then garbage: answered hello, then closed.
        assert (await raw([hello, garbage])).startswith(encode({"ok": True, "v": 1}))
        assert await raw([hello, b"\xff\xff\xff\xff"]) != b""       # oversized length
        assert await raw([hello, encode({"not": "a request"})]) != b""
        assert await raw([garbage]) == b""                          # garbage before the hello
        info = await actor.info.remote()
        assert info["fast"]["fast_auth_failures"] >= 1
        assert info["fast"]["fast_bad_frames"] >= 4
        # The client's own connection and the actor are unharmed.
        hold = await client.hold("m", 100, "after-garbage")
        assert not hold.fallback and not conn.closed and client.fast_link.conns and \
            next(iter(client.fast_link.conns.values())) is conn
        assert await client.release("after-garbage")
        assert (await actor.info.remote())["fast"]["fast_open"] == 1
        await client.close()

    asyncio.run(scenario())


def test_waiting_hold_is_dropped_when_its_connection_ends(actor_name):
    name, actor = actor_name

    async def scenario():
        client = CapacityClient(namespace=NS, name=name, snapshot_path="", call_timeout_s=30)
        await client.heartbeat(beat(1, max_=1000))
        assert (await client.hold("m", 1000, "full")).replica_id == "r0"
        ep = await actor.endpoint.remote()
        conn = await FastConnection.open(ep["host"], ep["port"], ep["token"], 5.0)
        waiting = asyncio.ensure_future(conn.request([["hold", "m", 500, "w", None, [], 30.0]], 40))
        for _ in range(200):
            if (await actor.info.remote())["waiting"] == 1:
                break
            await asyncio.sleep(0.02)
        conn.close()                    # the client is gone: its waiter must never be granted
        with pytest.raises(FastFailed):
            await waiting
        for _ in range(200):
            if (await actor.info.remote())["waiting"] == 0:
                break
            await asyncio.sleep(0.02)
        assert await client.release("full")
        snap = await client.snapshot()
        assert snap["outstanding_raw_tokens"] == 0
        assert (await actor.info.remote())["waits"]["dropped"] == 1

    asyncio.run(scenario())


def test_kill_mid_stream_falls_back_then_reconnects(ray_session):
    ray = ray_session
    name, actor = make_actor()

    async def scenario():
        client = CapacityClient(namespace=NS, name=name, snapshot_path="", call_timeout_s=30,
                                fast_retry_s=0.05, max_backoff_s=0.5)
        seq = await until_fast(client)
        first = await actor.endpoint.remote()
        assert await client.hold("m", 100, "kept")
        assert await client.commit("kept", "r0")
        stop = False
        done, errors = 0, []

        async def stream(i):
            nonlocal done
            n = 0
            while not stop:
                rid = f"s{i}-{n}"
                n += 1
                try:
                    h = await client.hold("m", 10, rid)
                    await client.release(rid)
                    done += not h.fallback
                except Exception as e:  # noqa: BLE001 - recorded; the stream must survive
                    errors.append(e)
                await asyncio.sleep(0.005)

        tasks = [asyncio.ensure_future(stream(i)) for i in range(4)]
        await asyncio.sleep(0.3)
        faults_before = client.fast_faults
        ray.kill(actor, no_restart=False)
        for _ in range(600):                      # the restarted actor answers on a new endpoint
            new = await actor.endpoint.remote()
            if new and new["pid"] != first["pid"]:
                break
            await asyncio.sleep(0.05)
        assert new["pid"] != first["pid"] and new["token"] != first["token"]
        # The replica's next heartbeat lists "kept": the reservation is re-established.
        seq += 1
        await client.heartbeat(beat(seq, active=[("kept", 100)]))
        fast_before = client.fast_batches
        deadline = time.monotonic() + 20
        while client.fast_batches == fast_before or not client.fast_link.conns:
            assert time.monotonic() < deadline, "never reconnected to the restarted actor"
            await asyncio.sleep(0.05)
        stop = True
        await asyncio.gather(*tasks)
        assert client.fast_faults > faults_before           # it noticed the dead connection
        # Until the heartbeat above, the restarted actor knows no replica: "unknown_model".
        errors = [e for e in errors if getattr(e, "reason", None) != "unknown_model"]
        assert done > 0 and not errors, errors[:3]
        info = await actor.info.remote()
        assert info["pid"] == new["pid"] and info["fast"]["fast_batches"] > 0
        snap = await client.snapshot()
        assert snap["outstanding_raw_tokens"] == 100         # "kept" only; the stream released all
        assert await client.release("kept")
        assert (await client.snapshot())["outstanding_raw_tokens"] == 0
        await client.close()

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(actor, no_restart=True)


def test_one_client_from_two_event_loops(actor_name):
    # A Serve router and a replica's own loop may share a client: one connection per loop.
    name, _ = actor_name
    client = CapacityClient(namespace=NS, name=name, snapshot_path="", call_timeout_s=30)

    async def use(rid, seq0):
        await until_fast(client, seq0)
        conn = client.fast_link.conns[asyncio.get_running_loop()]
        assert (await client.hold("m", 10, rid)).replica_id == "r0"
        assert await client.release(rid)
        assert not conn.closed and client.fast_link.conns[asyncio.get_running_loop()] is conn
        return conn

    first = asyncio.run(use("loop1", 100))
    second = asyncio.run(use("loop2", 200))
    # Each loop had its own connection; it closed with its loop, which is no fault.
    assert first is not second and first.closed and client.fast_faults == 0


def test_an_unframeable_batch_goes_through_ray_and_keeps_the_connection(actor_name, monkeypatch):
    name, _ = actor_name
    import capacity.transport.fastpath as fastpath

    async def scenario():
        client = CapacityClient(namespace=NS, name=name, snapshot_path="", call_timeout_s=30)
        await until_fast(client)
        conn = next(iter(client.fast_link.conns.values()))
        monkeypatch.setattr(fastpath, "MAX_FRAME", 64)     # client side only: this process
        ray_before = client.ray_batches
        assert (await client.hold("m", 10, "x" * 100)).replica_id == "r0"   # > 64 bytes: Ray
        assert client.ray_batches == ray_before + 1 and not conn.closed and client.fast_faults == 0
        monkeypatch.setattr(fastpath, "MAX_FRAME", 8 * 2**20)
        assert await client.release("x" * 100)
        assert client.ray_batches == ray_before + 1              # back on the direct connection
        await client.close()

    asyncio.run(scenario())


def test_repeated_direct_failures_warn_once_per_streak(caplog):
    # Real refusals: the discovered endpoint is a local port nothing listens on (what a firewall
    # that rejects the actor's ephemeral port looks like to the client). No Ray needed.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]

    async def discover():
        return {"host": "127.0.0.1", "port": closed_port, "token": "t"}

    async def attempts(n):
        link = FastLink(discover, timeout_s=2.0, retry_s=0.0, max_backoff_s=0.0,
                        spawn=asyncio.ensure_future)
        loop = asyncio.get_running_loop()
        for _ in range(n):
            await link.connect(loop)
        return link

    with caplog.at_level(logging.WARNING, logger="orchard.capacity"):
        link = asyncio.run(attempts(6))
    warnings = [r for r in caplog.records if "fast path failed" in r.getMessage()]
    assert link.faults == 6 and not link.conns and len(warnings) == 1
    assert "3 times in a row" in warnings[0].getMessage()
    assert "firewall" in warnings[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="orchard.capacity"):
        link.answered()          # the next batch that comes back over a direct connection
    assert any("restored after 6 failed attempts" in r.getMessage() for r in caplog.records)
