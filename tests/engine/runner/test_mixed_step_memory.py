"""A step that mixes prefill and decode (two model calls) updates the KV page arrays in place.

Left lazy, the second call's K/V writes become a second consumer of the array version the first
call's attention still reads, and MLX copies every page array instead of updating it in place:
seconds per mixed step on a real pool (SmolLM2, 6 GB). Measured here as memory: the step's peak
must stay far below one copy of the pool."""
import asyncio

from tests.engine_helpers import PAGE_BYTES_LLAMA, make_engine, req, started, wait_idle


class Releases:
    def __init__(self):
        self.events = []

    def __call__(self, event, **fields):
        if event == "release":
            self.events.append(fields)


def test_a_mixed_prefill_and_decode_step_does_not_copy_the_kv_pool(tiny_llama):
    trace = Releases()
    pages = 1024                                   # 32 MiB of K/V pages in 4 arrays
    eng = make_engine(tiny_llama, pages=pages, max_step_tokens=256, trace=trace)
    try:
        async def scenario():
            decoding, _ = await started(eng, req("dec", n_prompt=8, max_tokens=400,
                                                 ignore_eos=True))
            trace.events.clear()
            # A long prompt arrives: its prefill chunks share steps with the decode row.
            agen, _ = await started(eng, req("pre", n_prompt=200, pseed=3, max_tokens=2))
            async for _ in agen:
                pass
            eng.cancel("dec")
            async for _ in decoding:
                pass
        asyncio.run(scenario())
        wait_idle(eng)
        pool_bytes = pages * PAGE_BYTES_LLAMA
        over = max(e["peak"] - e["active_before"] for e in trace.events)
        assert trace.events and over < pool_bytes / 8, (over, pool_bytes)
    finally:
        eng.shutdown()
