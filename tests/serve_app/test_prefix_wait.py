"""The router's affine wait (serve_app/routing.py), built in this process against the actor's own
batch path (capacity/ops.py, no Ray): a request whose caching replica is full waits for it, up to
prefix_wait_s (or, by default, about the prefill its cached prefix saves: capacity/affine_bound.py),
and is held there when it frees; when the wait runs out the ordinary hold routes it
by headroom; with no wait allowed it never waits. The client is the real CapacityClient, its
transport replaced by the batch path (both transports carry the same encoded ops)."""
import asyncio
from collections import namedtuple
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from capacity.fleet import Fleet, FleetConfig
from capacity.operations import encode_op
from capacity.ops import BatchOps
from capacity.rates import RequestSample
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from serve_app.calls import GenerateCall
from serve_app.routing import CapacityRouter
from tests.capacity.test_wait import beat
from tests.fixtures.conditions import until

REPLICAS = ("r0", "r1")
ReplicaID = namedtuple("ReplicaID", "unique_id")


class Router(CapacityRouter):
    """Two replicas that Serve would hand the router; r0 caches the prompts' prefix."""

    @property
    def curr_replicas(self):
        return {ReplicaID(u): SimpleNamespace(routing_stats={}) for u in REPLICAS}


class CachedOnR0:
    def observe(self, uid, report):
        pass

    def matches(self, live, tenant, prompt_ids):
        return {u: 640 if u == "r0" else 0 for u in live}


def service() -> BatchOps:
    ops = BatchOps(Fleet(FleetConfig.from_dict({"caps": {"native_seeds": {"m": 400.0}}})))
    ops.apply([("heartbeat", beat(1)), ("heartbeat", beat(1, replica="r1"))])
    return ops


def make_router(ops: BatchOps, **capacity) -> Router:
    router = Router(deployment_id=DeploymentID(name="m", app_name="prefix-wait"),
                    handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(capacity={"namespace": "prefix-wait", "snapshot_path": "",
                                      **capacity})
    router.prefix = CachedOnR0()

    async def send(batch, timeout=None, remake=None):
        out = ops.apply([encode_op(op) for op in batch])
        return [await r if isinstance(r, asyncio.Future) else r for r in out]

    router.client._send = router.client._batcher.send = send
    return router


def call(request_id: str) -> GenerateCall:
    # 10 prompt + 490 max tokens: 500 raw tokens, half a replica.
    return GenerateCall(GenerationRequest(request_id, list(range(10)),
                                          SamplingParams(max_tokens=490)), model="m")


def fill_r0(ops: BatchOps) -> None:
    assert ops.apply([("hold", "m", 1000, "fill", None, ("r1",))])[0]["hold"].replica_id == "r0"


def test_a_request_waits_for_its_full_caching_replica_and_is_held_there():
    async def scenario():
        ops = service()
        fill_r0(ops)
        router = make_router(ops, prefix_wait_s=30)
        task = asyncio.create_task(router._affine_hold(call("turn2")))

        async def parked():
            return ops.waits.affine_waiting("m") == ["turn2"]

        await until(parked, what="the request waiting for r0")
        assert not task.done()                  # r1 has room, yet it waits for its cache
        ops.apply([("release", "fill", None)])
        hold = await asyncio.wait_for(task, 10)
        assert hold.replica_id == "r0" and hold.ranking[0] == "r0"
        assert router.stats["prefix_waited"] == 1 and router.stats["prefix_wait_granted"] == 1
        assert router.stats["prefix_full"] == 0 and router.waiting["m"] == 0

    asyncio.run(scenario())


def test_when_the_wait_runs_out_headroom_routes_it_and_no_wait_means_none():
    async def scenario():
        ops = service()
        fill_r0(ops)
        router = make_router(ops, prefix_wait_s=0.1)
        assert await router._affine_hold(call("turn2")) is None
        assert router.stats["prefix_waited"] == 1 and router.stats["prefix_full"] == 1
        assert router.stats["prefix_wait_granted"] == 0 and ops.waits.stats.affine_timed_out == 1
        assert (await router._hold(call("turn2"), spent_s=0.1)).replica_id == "r1"
        # queue_timeout_s bounds the affine wait too: 0 refuses at once, without waiting.
        eager = make_router(ops, prefix_wait_s=30, queue_timeout_s=0)
        assert await eager._affine_hold(call("turn3")) is None
        assert eager.stats["prefix_waited"] == 0 and eager.stats["prefix_full"] == 1
        assert ops.waits.stats.affine_parked == 1

    asyncio.run(scenario())


def test_the_wait_follows_the_prefill_the_cached_prefix_saves():
    # Default settings (no prefix_wait_s): the router sends its 640 cached tokens and the
    # queue_timeout_s cap; at a learned 80 tok/s the actor bounds the wait at 8 s (not 2 s).
    async def scenario():
        ops = service()
        key = ops.fleet.ledger.replica("m", "r0").key
        for _ in range(5):
            ops.fleet.rates.record_request(key, RequestSample(800, 1, 10.0, None))
        fill_r0(ops)
        router = make_router(ops)
        task = asyncio.create_task(router._affine_hold(call("turn2")))

        async def parked():
            return ops.waits.affine_waiting("m") == ["turn2"]

        await until(parked, what="the request waiting for r0")
        left = ops.waits._by_id["turn2"].timer.when() - asyncio.get_running_loop().time()
        assert 7.0 < left <= 8.0
        ops.apply([("release", "fill", None)])
        assert (await asyncio.wait_for(task, 10)).replica_id == "r0"

    asyncio.run(scenario())
