"""Thread -> asyncio bridge: the engine thread hands items to a caller's event loop.

Each `generate` call captures its own running loop, so the engine serves callers on any number of
event loops (a Ray Serve replica's, a test's `asyncio.run`, ...). The engine thread never blocks
on a consumer: it schedules `put_nowait` on the consumer's loop and moves on.
"""
from __future__ import annotations

import asyncio


class Sink:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False   # set once the final item was handed over (or the loop is gone)

    def put(self, item, final: bool = False) -> bool:
        """Deliver from the engine thread; False when the consumer's loop has gone away."""
        return hand_over([(self, item, final)])[0]


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def hand_over(batch: list[tuple[Sink, object, bool]]) -> list[bool]:
    """Deliver (sink, item, final) triples with ONE wake-up per consumer loop, not one per item:
    a step's deltas for a whole batch of requests cost one cross-thread call per event loop.
    Returns per triple whether it was delivered (False: the sink or its loop has gone)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    ok = []
    for sink, item, final in batch:
        if sink.closed:
            ok.append(False)
            continue
        by_loop.setdefault(sink.loop, []).append((sink.queue, item))
        sink.closed = final
        ok.append(True)
    dead = set()
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:   # event loop closed: nobody will read these streams again
            dead.add(loop)
    if not dead:
        return ok
    for i, (sink, _, _) in enumerate(batch):
        if sink.loop in dead:
            sink.closed = True
            ok[i] = False
    return ok

