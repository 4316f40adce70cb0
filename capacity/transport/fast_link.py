"""The client side of the direct transport: one connection per event loop, found in the background.

CapacityClient (serve_app/capacity_client.py) sends a batch here when `conn()` has a live
connection and through Ray otherwise. This file owns the state that decision needs: where the
actor listens (asked through a `discover` coroutine, so no Ray here), the connection of each loop
(asyncio streams are bound to the loop that opened them; a Serve router and a replica may share
one client from different loops), and the backoff after failures: any failure forgets the
endpoint (a restarted actor has a new port and token) and waits `retry_s`, doubling up to
`max_backoff_s`, before discovering again. A streak of `WARN_AFTER` failures is logged once as a
warning (a firewall blocking the actor's ephemeral port looks like this), and its end once more.
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Awaitable, Callable

from capacity.transport.fastpath import FastConnection, FastFailed

log = logging.getLogger("orchard.capacity")

WARN_AFTER = 3               # consecutive direct-transport failures before a warning (per streak)


class FastLink:
    def __init__(self, discover: Callable[[], Awaitable[dict | None]], *, timeout_s: float,
                 retry_s: float, max_backoff_s: float,
                 spawn: Callable[[Awaitable[None]], asyncio.Task]):
        self._discover = discover             # -> {host, port, token} or None (no listener)
        self.timeout_s = timeout_s
        self.retry_s = retry_s                # first wait before rediscovering the endpoint
        self.max_backoff_s = max_backoff_s
        self._spawn = spawn                   # the client's task keeper
        self.batches = 0                      # batches answered over a direct connection
        self.faults = 0                       # direct-connection failures (each fell back)
        self._failures = 0                    # consecutive, for the backoff and the warning
        self._retry_at = 0.0
        self._endpoint: dict | None = None
        self.conns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._connecting: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def conn(self) -> FastConnection | None:
        """This loop's live connection, or None (then connect in the background; never wait)."""
        if time.monotonic() < self._retry_at:
            return None
        loop = asyncio.get_running_loop()
        conn = self.conns.get(loop)
        if conn is not None and not conn.closed:
            return conn
        if loop not in self._connecting:
            self._connecting[loop] = self._spawn(self.connect(loop))
        return None

    async def connect(self, loop) -> None:
        try:
            if self._endpoint is None:
                self._endpoint = await self._discover()
            ep = self._endpoint
            if not ep:
                raise FastFailed("the actor serves no direct endpoint")
            self.conns[loop] = await FastConnection.open(ep["host"], ep["port"], ep["token"],
                                                         self.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure here only means "stay on Ray"
            self.fault(None, e)
        finally:
            self._connecting.pop(loop, None)

    def answered(self) -> None:
        """A batch came back over a direct connection."""
        self.batches += 1
        if self._failures >= WARN_AFTER:
            log.warning("capacity fast path restored after %d failed attempts", self._failures)
        self._failures = 0

    def fault(self, conn: FastConnection | None, why: Exception) -> None:
        self.faults += 1
        self._failures += 1
        self._endpoint = None
        if conn is not None:
            conn.close(f"fault: {why}")
        self._retry_at = time.monotonic() + min(
            self.max_backoff_s, self.retry_s * 2 ** min(self._failures - 1, 16))
        log.debug("capacity fast path unavailable (%s); Ray calls for now", why)
        if self._failures == WARN_AFTER:   # once per streak: say it, do not spam
            log.warning(
                "capacity fast path failed %d times in a row (last: %s); capacity calls go "
                "through Ray meanwhile (slower: p99 ~25 ms instead of ~4 ms per hold). If this "
                "persists, check that this node can open TCP connections to the capacity "
                "actor's node on ephemeral ports (firewall).", self._failures, why)

    def close(self) -> None:
        """Close this loop's connection."""
        conn = self.conns.pop(asyncio.get_running_loop(), None)
        if conn is not None:
            conn.close()
