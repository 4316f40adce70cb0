"""CapacityClient batching without Ray (the transport is stubbed)."""
import asyncio

import pytest

from serve_app.capacity_client import CapacityClient


class StubClient(CapacityClient):
    def __init__(self, **kw):
        super().__init__(create=False, **kw)
        self.calls: list[list] = []

    async def _call(self, method, *args, timeout=None):
        assert method == "apply"
        ops = args[0]
        self.calls.append(ops)
        await asyncio.sleep(0.001)
        return [{"ok": True, "hold": op[3]} if op[0] == "hold" else True for op in ops]


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_next_call_after_a_batch_is_sent_without_other_traffic(max_inflight):
    # Regression: the caller woken by a batch queued its next call before the finished flusher
    # left the in-flight set, so that call waited for unrelated traffic (forever with one slot).
    async def run():
        c = StubClient(max_inflight=max_inflight)
        for i in range(20):
            assert await c.hold("m", 1, f"r{i}") == f"r{i}"
            assert await c.release(f"r{i}") is True
        return c

    c = asyncio.run(asyncio.wait_for(run(), 5.0))
    assert len(c.calls) == 40 and c._batcher.inflight == 0


def test_concurrent_calls_are_batched():
    async def run():
        c = StubClient(max_inflight=1)
        await asyncio.gather(*(c.hold("m", 1, f"r{i}") for i in range(50)))
        return c

    c = asyncio.run(asyncio.wait_for(run(), 5.0))
    assert sum(len(b) for b in c.calls) == 50 and len(c.calls) <= 3 and c._batcher.inflight == 0
