"""The router's cold-start gate against a real capacity actor: a hold whose TTFT is the cold
bound of an unmeasured identity, beyond the request's first-token deadline, is cancelled and
refused (deadline_unreachable, 503 + Retry-After), nothing left debited; a deadline the bound
fits, or none, is held as before. The router is built in this process (no Serve app needed)."""
import asyncio
import time
import uuid

import pytest

from capacity.errors import CapacityRefused
from engine.request import GenerationRequest
from engine.sampling.params import SamplingParams
from serve_app.calls import GenerateCall
from serve_app.errors import from_exception
from serve_app.routing import CapacityRouter


def beat(seq):
    # A replica with no measured rates: its forecast is the cold bound (30 s by default).
    return {"replica_id": "r0", "node_id": "r0", "chip_class": "M4|Max", "incarnation": 1,
            "seq": seq, "slots": [{"model_id": "m", "state": "running", "raw_budget_used": 0,
                                  "raw_budget_max": 10_000, "max_concurrency": 8,
                                  "kv_bytes_per_token": 1}]}


def call(request_id, deadline_s):
    return GenerateCall(GenerationRequest(request_id, list(range(10)),
                                          SamplingParams(max_tokens=4)), model="m",
                        first_token_deadline_unix=None if deadline_s is None
                        else time.time() + deadline_s)


def make_router(namespace):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = CapacityRouter(deployment_id=DeploymentID(name="m", app_name="gate"),
                            handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(capacity={"namespace": namespace, "snapshot_path": "",
                                      "prefix_routing": False, "queue_timeout_s": 0})
    return router


def test_a_deadline_shorter_than_the_cold_bound_is_refused_with_nothing_debited(ray_session):
    ray = ray_session
    namespace = f"gate-{uuid.uuid4().hex[:8]}"

    async def scenario():
        router = make_router(namespace)
        await router.client.heartbeat(beat(1))
        with pytest.raises(CapacityRefused) as refused:
            await router._hold(call("short", 5.0))
        assert refused.value.reason == "deadline_unreachable"
        err = from_exception(refused.value)
        assert err.status == 503 and err.retry_after_s >= 30.0
        snap = await router.client.snapshot()
        assert snap["outstanding_raw_tokens"] == 0
        # A deadline the bound fits, and no deadline, are held (the bound only ranks them).
        for rid, deadline_s in (("long", 60.0), ("none", None)):
            hold = await router._hold(call(rid, deadline_s))
            assert hold.replica_id == "r0" and hold.ttft_bound
        assert router.stats["refusals"] == 1 and router.stats["holds"] == 3
        for rid in ("long", "none"):
            await router.client.cancel(rid)
        assert (await router.client.snapshot())["outstanding_raw_tokens"] == 0
        await router.client.close()

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(ray.get_actor("capacity", namespace=namespace), no_restart=True)
