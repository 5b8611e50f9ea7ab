"""A request's output stream as the server holds it: iterate it for the outputs, `close()` to abort.

Torch-free, so the Ray Serve ingress (brisk.cluster.remote) uses the same handle as the in-process
engine (brisk.engine.async_engine): `engine` only needs `abort(request_id)`.
"""

from __future__ import annotations

import asyncio

from brisk.engine.errors import RequestFailedError
from brisk.engine.outputs import RequestOutput


class RequestStream:
    """One request's outputs, in order; `close()` aborts it unless it already finished."""

    def __init__(self, engine, request_id: str, outputs: asyncio.Queue):
        self.engine, self.request_id, self._outputs = engine, request_id, outputs
        self.done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.done = True  # the engine already dropped it (fail, death)
            raise item
        if item.finished:
            self.done = True
            if item.error is not None:  # it failed by itself; the engine already freed it
                raise RequestFailedError(item.request_id, *item.error)
        return item

    def mark_done(self) -> None:
        """Its final output (or failure) was received through a sink: closing has nothing to abort."""
        self.done = True

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)
