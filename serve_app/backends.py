"""How the ingress reaches a model: through a Serve handle, or an in-process ModelServer.

Both expose the same two calls, so the HTTP layer is one code path whether it runs behind
Ray Serve or in one process (the TTFT-overhead bench compares exactly these two).
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from serve_app.calls import GenerateCall
from serve_app.wire import decode


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's task-error wrappers (same-process ones pass through)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None) or exc.__cause__
        if inner is None or not type(exc).__module__.startswith("ray"):
            break
        exc = inner
    return exc


class RayBackend:
    """A model deployment behind a Serve handle; configured handles are built once and cached."""

    def __init__(self, handle: Any):
        self._handle = handle
        # Items cross Ray as bytes (ModelDeployment.generate_wire; serve_app/wire.py says why).
        self._stream = handle.options(stream=True, method_name="generate_wire")
        self._info = handle.options(method_name="info")

    async def stream(self, call: GenerateCall) -> AsyncIterator[dict]:
        gen = self._stream.remote(call)
        finished = False
        try:
            async for data in gen:
                yield decode(data)
            finished = True
        finally:
            if not finished:
                # Client went away (or we stopped early): cancel the replica-side generator so
                # the engine frees pages and the reservation is released.
                gen.cancel()

    async def info(self) -> dict:
        return await self._info.remote()


class LocalBackend:
    """An in-process ModelServer (no Ray): tests of the HTTP layer and the overhead bench."""

    def __init__(self, server: Any):
        self.server = server

    async def stream(self, call: GenerateCall) -> AsyncIterator[dict]:
        agen = self.server.generate(call)
        try:
            async for item in agen:
                yield item
        finally:
            await agen.aclose()

    async def info(self) -> dict:
        return await self.server.info()
