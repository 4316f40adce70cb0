"""Timer-free batching of a client's calls to the capacity actor (pure asyncio, no Ray).

The first call is sent at once; whatever queues while `max_inflight` batches are in flight goes
in the next one. So an idle client adds no latency and a busy one makes one actor call per
batch (200 concurrent callers cost a handful of calls, not 200). Each batch is applied in order.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable


class ReportBatcher:
    def __init__(self, send: Callable[[list], Awaitable[list]], *, max_batch: int = 512,
                 max_inflight: int = 2, failure: type[BaseException] = Exception):
        self.send = send                  # one batch of ops -> one result per op, in order
        self.max_batch = max_batch
        # Batches in flight at once. >1 overlaps one batch's actor time with the next one's
        # transport; safe because callers issue dependent calls (hold -> commit -> release of one
        # request) only after the previous one returned, and heartbeats carry sequence numbers.
        self.max_inflight = max(1, max_inflight)
        self.failure = failure            # what `send` raises for a whole batch: each caller gets it
        self._queue: list[tuple[tuple, asyncio.Future]] = []
        self._flushers: set[asyncio.Task] = set()
        # Flushers running or about to run. Counted here, not as len(self._flushers): a task leaves
        # that set in a done callback, which runs after the callers its last batch woke. A caller
        # that queued its next call (release right after hold) in between used to see the finished
        # flusher as in flight, start none, and wait for some unrelated later call to send it (or
        # forever, with max_inflight=1 and no other traffic).
        self.inflight = 0

    async def submit(self, op: tuple) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((op, fut))
        if self.inflight < self.max_inflight:
            self.inflight += 1
            task = loop.create_task(self._flush_loop())
            self._flushers.add(task)
            task.add_done_callback(self._flushers.discard)
        return await fut

    async def _flush_loop(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                try:
                    results = await self.send([op for op, _ in batch])
                except self.failure as e:
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                for (_, fut), res in zip(batch, results):
                    if not fut.done():
                        fut.set_result(res)
        finally:
            # Same step as the empty-queue check above (no await between): a call queued after
            # this point sees the slot free and starts its own flusher.
            self.inflight -= 1

    async def flush(self) -> None:
        """Wait until every queued call has been sent and answered."""
        while self._flushers:
            await asyncio.gather(*list(self._flushers), return_exceptions=True)
