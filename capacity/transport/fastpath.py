"""Direct hot-path transport between CapacityClient and the capacity actor (no Ray in this file).

A Ray actor call costs 1.3-3 ms on a busy 2-core box (core worker, gRPC, thread wake-ups), and a
hold+release pair is two dependent calls. So the actor also serves an asyncio stream server on its
own event loop, and clients send their batches over one persistent TCP connection:

    frame    = 4-byte big-endian length + msgpack body (at most MAX_FRAME bytes)
    hello    = {"token": <per-incarnation secret>, "v": 1}  ->  {"ok": true, "v": 1} or close
    request  = [id, ops]            ops in their wire form (capacity/operations.py), in order
    reply    = [id, results]        or [id, null, "<error>"]; replies may come out of order

The first frame must be the hello (at most MAX_HELLO bytes, within HELLO_TIMEOUT_S); a bad token,
an oversized or undecodable frame, or a request of the wrong shape closes that connection and
nothing else. Every failure on the client
side raises FastFailed, and the client sends that batch through Ray instead.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import struct
from typing import Any, Callable

import msgpack

log = logging.getLogger("orchard.capacity.fastpath")

WIRE_VERSION = 1
MAX_FRAME = 8 * 2**20          # a batch of 512 heartbeats with short active lists fits easily
HELLO_TIMEOUT_S = 5.0          # an unauthenticated connection may not idle longer than this
MAX_HELLO = 1024               # nor make the actor buffer more than this
_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """A frame that is too large, empty, or not msgpack."""


class FastFailed(Exception):
    """The direct connection could not carry this batch; send it through Ray instead."""


class FastUnsendable(FastFailed):
    """This batch could not go over the direct connection (too large or unencodable to frame, or
    the actor could not answer it), but the connection itself is fine."""


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True, default=_default)
    if len(body) > MAX_FRAME:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME) -> Any:
    """Raises asyncio.IncompleteReadError on EOF, FrameError on a bad frame."""
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if n == 0 or n > max_bytes:
        raise FrameError(f"frame length {n} out of bounds")
    body = await reader.readexactly(n)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for garbage
        raise FrameError(f"undecodable frame: {type(e).__name__}") from e


# ---- server (runs on the actor's event loop) ------------------------------------------------

ApplyFn = Callable[[list, object], list]   # (ops, connection owner) -> results or futures


class FastServer:
    """`apply(ops, owner)` returns one result per op; a waiting hold's result is a future, and
    that request's reply is written when every future of it is done (other requests on the same
    connection are not held up). `on_close(owner)` runs when a connection ends."""

    def __init__(self, token: str, apply: ApplyFn, on_close: Callable[[object], None]):
        self.token = token
        self.apply, self.on_close = apply, on_close
        self.host: str | None = None
        self.port: int | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self.stats = {"fast_connections": 0, "fast_open": 0, "fast_batches": 0, "fast_ops": 0,
                      "fast_auth_failures": 0, "fast_bad_frames": 0}

    async def start(self, host: str) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._connection, host, 0)
        self.host, self.port = host, self._server.sockets[0].getsockname()[1]
        return self.host, self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        owner = object()            # identifies this connection's waiting holds
        self.stats["fast_connections"] += 1
        self.stats["fast_open"] += 1
        try:
            if not await self._authenticate(reader, writer):
                return
            while True:
                try:
                    msg = await read_frame(reader)
                except asyncio.IncompleteReadError:
                    return                                          # the client hung up
                if not (isinstance(msg, list) and len(msg) == 2 and isinstance(msg[0], int)
                        and isinstance(msg[1], list)):
                    raise FrameError("a request must be [id, ops]")
                rid, ops = msg
                self.stats["fast_batches"] += 1
                self.stats["fast_ops"] += len(ops)
                try:
                    results = self.apply(ops, owner)
                except Exception as e:  # noqa: BLE001 - a bug in one batch must not drop the
                    log.exception("capacity fast path: batch failed")   # connection's waiters
                    writer.write(encode([rid, None, f"{type(e).__name__}: {e}"[:500]]))
                    continue
                if any(isinstance(r, asyncio.Future) for r in results):
                    task = asyncio.get_running_loop().create_task(self._reply_later(writer, rid, results))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    self._reply(writer, rid, results)
                await writer.drain()
        except FrameError as e:
            self.stats["fast_bad_frames"] += 1
            log.warning("capacity fast path: closing a connection: %s", e)
        except (ConnectionError, OSError):
            pass
        finally:
            self.stats["fast_open"] -= 1
            self.on_close(owner)
            writer.close()

    async def _authenticate(self, reader, writer) -> bool:
        try:
            hello = await asyncio.wait_for(read_frame(reader, MAX_HELLO), HELLO_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            self.stats["fast_auth_failures"] += 1
            return False
        token = hello.get("token") if isinstance(hello, dict) else None
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            self.stats["fast_auth_failures"] += 1
            writer.write(encode({"ok": False, "error": "auth"}))
            return False
        writer.write(encode({"ok": True, "v": WIRE_VERSION}))
        return True

    def _reply(self, writer: asyncio.StreamWriter, rid: int, results: list) -> None:
        if writer.is_closing():
            return
        try:
            frame = encode([rid, results])
        except (FrameError, TypeError, ValueError, OverflowError) as e:
            frame = encode([rid, None, f"{type(e).__name__}: {e}"[:500]])   # client uses Ray
        writer.write(frame)

    async def _reply_later(self, writer, rid: int, results: list) -> None:
        done = [await asyncio.shield(r) if isinstance(r, asyncio.Future) else r for r in results]
        self._reply(writer, rid, done)


# ---- client connection -----------------------------------------------------------------------

class FastConnection:
    """One authenticated connection, bound to the event loop that opened it. Requests are matched
    to replies by id, so any number may be in flight."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.loop = asyncio.get_running_loop()
        self.pending: dict[int, asyncio.Future] = {}
        self.closed = False
        self._next = 0
        self._task = self.loop.create_task(self._read_loop())

    @classmethod
    async def open(cls, host: str, port: int, token: str, timeout_s: float) -> "FastConnection":
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise FastFailed(f"connect {host}:{port}: {type(e).__name__}: {e}") from e
        try:
            writer.write(encode({"token": token, "v": WIRE_VERSION}))
            reply = await asyncio.wait_for(read_frame(reader), timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, FrameError) as e:
            writer.close()
            raise FastFailed(f"hello: {type(e).__name__}: {e}") from e
        if not (isinstance(reply, dict) and reply.get("ok")):
            writer.close()
            raise FastFailed(f"hello refused: {reply!r}"[:200])
        return cls(reader, writer)

    async def request(self, ops: list, timeout_s: float) -> list:
        if self.closed:
            raise FastFailed("connection closed")
        self._next += 1
        rid = self._next
        try:
            frame = encode([rid, ops])
        except (FrameError, TypeError, ValueError, OverflowError) as e:
            raise FastUnsendable(f"{type(e).__name__}: {e}"[:300]) from e
        fut = self.loop.create_future()
        self.pending[rid] = fut
        try:
            self.writer.write(frame)
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError as e:
            self.close(f"request timed out after {timeout_s:.3g} s")
            raise FastFailed("timeout") from e
        except OSError as e:
            raise FastFailed(f"send: {type(e).__name__}: {e}") from e
        finally:
            self.pending.pop(rid, None)

    async def _read_loop(self) -> None:
        why = "closed by the actor"
        try:
            while True:
                msg = await read_frame(self.reader)
                fut = self.pending.pop(msg[0], None) if isinstance(msg, list) and msg else None
                if fut is None or fut.done():
                    continue
                if len(msg) == 2 and isinstance(msg[1], list):
                    fut.set_result(msg[1])
                else:
                    fut.set_exception(FastUnsendable(f"actor could not answer: {msg[2:]!r}"[:300]))
        except (asyncio.IncompleteReadError, FrameError, OSError) as e:
            why = f"{type(e).__name__}: {e}"
        except asyncio.CancelledError:
            why = "closed"
        finally:
            self.close(why)

    def close(self, why: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(FastFailed(why))
        self.pending.clear()
        self.writer.close()
        if self._task is not asyncio.current_task(self.loop):
            self._task.cancel()
