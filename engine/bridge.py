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
        if self.closed:
            return False
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # event loop closed: nobody will read this stream again
            self.closed = True
            return False
        self.closed = final
        return True
