"""The capacity actor under real Ray: a kill-and-restart restores rate histories from the snapshot
file and re-establishes reservations from replica reports; the client falls back locally when the
actor does not exist. Uses the session-wide Ray (tests/fixtures/ray_session.py)."""
import asyncio
import json
import time
import uuid

from capacity.actor import get_or_create_actor
from capacity.protocol import RequestTelemetry
from serve_app.capacity_client import CapacityClient
from capacity.errors import CapacityRefused

NS = "orchard-test"
INT4 = "kvq-v1:affine-v1-k4v4-g64-f32-h128-s1:prefill=direct"


def beat(seq, *, running=1, tps=None, used=0, active=()):
    return {"replica_id": "r0", "node_id": "box", "chip_class": "M4|Max", "incarnation": 1,
            "seq": seq, "slots": [{
                "model_id": "m", "state": "running", "execution_identity": INT4,
                "num_running": running, "raw_budget_used": used, "raw_budget_max": 10_000,
                "max_concurrency": 24, "kv_bytes_per_token": 6400, "observed_decode_tps": tps,
                "active": [{"request_id": r, "raw_tokens": t} for r, t in active]}]}


def _solo_samples(path):
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return 0
    return sum(len(h["solo"]) for _, h in state["rates"]["histories"])


def test_kill_restores_histories_and_reservations(ray_session, tmp_path):
    ray = ray_session
    name = f"capacity-{uuid.uuid4().hex[:8]}"
    path = str(tmp_path / "rates.json")
    actor = get_or_create_actor(NS, name, snapshot_path=path, persist_interval_s=0.2,
                                reap_interval_s=0.05)

    async def before_kill():
        client = CapacityClient(namespace=NS, name=name, snapshot_path=path, call_timeout_s=30)
        caps = [(await client.heartbeat(beat(s, tps=76.0)))["caps"]["m"] for s in range(1, 6)]
        assert caps == [1, 1, 1, 1, 12]          # uncalibrated int4 until its 5th solo sample
        hold = await client.hold("m", 300, "a")
        assert hold.replica_id == "r0" and not hold.fallback
        assert await client.commit("a", "r0")
        assert (await client.snapshot())["outstanding_raw_tokens"] == 300
        assert (await client.info()).capabilities       # negotiation view of the same actor
        return await actor.info.remote()

    try:
        info = asyncio.run(before_kill())
        deadline = time.monotonic() + 10
        while _solo_samples(path) < 5 and time.monotonic() < deadline:   # periodic persistence
            time.sleep(0.05)
        assert _solo_samples(path) == 5

        ray.kill(actor, no_restart=False)

        async def after_restart():
            client = CapacityClient(namespace=NS, name=name, snapshot_path=path, call_timeout_s=30)
            new = None
            for _ in range(200):   # calls are retried through the restart; wait for the new process
                new = await actor.info.remote()
                if new["pid"] != info["pid"]:
                    break
                await asyncio.sleep(0.05)
            assert new["pid"] != info["pid"] and new["restored"] and new["reconstructed"]
            snap = await client.snapshot()
            assert snap["outstanding_raw_tokens"] == 0 and snap["models"] == []
            # The replica's next heartbeat lists "a": the reservation is back, and the restored
            # history gives the int4 identity its measured cap at once (a fresh actor would say 1).
            out = await client.heartbeat(beat(6, used=300, active=[("a", 300)]))
            assert out["accepted"] and out["caps"]["m"] == 12
            assert (await client.snapshot())["outstanding_raw_tokens"] == 300
            assert await client.release("a", RequestTelemetry(prompt_tokens=100, batch_size=1,
                                                                ttft_s=0.2, tpot_s=0.013))
            assert not await client.release("a")                  # idempotent: no double refund
            assert (await client.snapshot())["outstanding_raw_tokens"] == 0

        asyncio.run(after_restart())
    finally:
        ray.kill(actor, no_restart=True)


def test_client_falls_back_to_a_local_cap_without_an_actor(ray_session):
    async def scenario():
        client = CapacityClient(namespace=NS, name=f"absent-{uuid.uuid4().hex[:8]}", create=False,
                                fallback_cap=1, backoff_s=0.01)
        first = await client.hold("m", 100, "x")
        assert first.fallback and first.ranking == []
        try:
            await client.hold("m", 100, "y")
            raise AssertionError("the local cap of 1 must refuse a second request")
        except CapacityRefused as e:
            assert e.reason == "capacity_unavailable"
        assert await client.release("x")                         # frees the local slot
        assert (await client.hold("m", 100, "y")).fallback
        assert client.faults >= 1

    asyncio.run(scenario())


def test_concurrent_callers_share_batches_balance_exactly_and_leaks_expire(ray_session):
    ray = ray_session
    name = f"capacity-{uuid.uuid4().hex[:8]}"
    # Seed 400 tok/s: qc = floor((400/15 - 1)/0.39) = 65, cap = ceil(65 * 1.2) = 79 >= 60 holds.
    actor = get_or_create_actor(NS, name, config={"caps": {"native_seeds": {"m": 400.0}},
                                                  "ledger": {"hold_ttl_s": 2.0}},
                                snapshot_path="", reap_interval_s=0.05)

    async def scenario():
        client = CapacityClient(namespace=NS, name=name, snapshot_path="", call_timeout_s=30)
        native = {**beat(1), "slots": [{**beat(1)["slots"][0], "execution_identity": None,
                                        "max_concurrency": 200}]}
        assert (await client.heartbeat(native))["accepted"]
        before = await actor.info.remote()
        holds = await asyncio.gather(*(client.hold("m", 10, f"c{i}") for i in range(60)))
        assert {h.replica_id for h in holds} == {"r0"} and not any(h.fallback for h in holds)
        assert (await client.snapshot())["outstanding_raw_tokens"] == 600
        assert all(await asyncio.gather(*(client.release(f"c{i}") for i in range(60))))
        after = await actor.info.remote()
        assert after["ops"] - before["ops"] == 120
        assert after["batches"] - before["batches"] < 60           # 120 calls, far fewer batches
        assert (await client.snapshot())["outstanding_raw_tokens"] == 0
        # A hold that never commits is refunded by the actor's own TTL reaper.
        await client.hold("m", 10, "leak")
        assert (await client.snapshot())["outstanding_raw_tokens"] == 10
        for _ in range(200):
            if (await client.snapshot())["outstanding_raw_tokens"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (await client.snapshot())["outstanding_raw_tokens"] == 0
        assert not await client.cancel("leak")                    # already refunded: no-op

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(actor, no_restart=True)
