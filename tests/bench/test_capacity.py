"""The bench's pacer, without Ray: an open-loop schedule must deliver the offered rate (the old
think-time pacer reported ~124 pairs/s for a 200/s target because its wall clock ran to the slowest
caller's last think time)."""
import asyncio

from bench.capacity import _paced, _round_trips


class FakeClient:
    def __init__(self, delay_s: float = 0.001):
        self.delay_s, self.held = delay_s, set()

    async def hold(self, model_id, raw_tokens, request_id):
        await asyncio.sleep(self.delay_s)
        self.held.add(request_id)

    async def release(self, request_id):
        await asyncio.sleep(self.delay_s)
        self.held.discard(request_id)
        return True


def test_paced_delivers_offered_rate():
    client = FakeClient()
    out = asyncio.run(_paced(client, callers=200, rate=400.0, duration_s=2.0))
    assert out["refused"] == 0 and not client.held
    assert 0.8 * 800 < out["pairs"] < 1.2 * 800            # Poisson count around rate * window
    assert 0.8 * 400 < out["pairs_per_s"] < 1.2 * 400
    assert out["p50_ms"] >= out["service_p50_ms"] >= 2.0     # two 1 ms calls per pair
    assert out["late_p50_ms"] < 20
    assert 1.0 <= out["hold_only_p50_ms"] <= out["service_p50_ms"]


def test_closed_loop_counts_every_pair():
    out = asyncio.run(_round_trips(FakeClient(0.0), callers=20, rounds=5))
    assert out["pairs"] == 100 and out["refused"] == 0
