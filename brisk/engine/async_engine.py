"""Async front of the engine: `generate()` yields RequestOutputs as tokens arrive,
`abort()` stops a request. The step loop runs in a background thread, so the event
loop stays responsive; every engine mutation happens on that thread (requests and
aborts are handed over through a queue and applied before the next step).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator

from brisk.engine.engine import LLMEngine
from brisk.engine.outputs import RequestOutput
from brisk.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop stopped with an error; open requests are ended with it."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="brisk-engine", daemon=True)
        self._thread.start()

    # -- public API (event-loop side) ----------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        done = loop.create_future()
        self._commands.put(("add", (prompt, params, request_id, priority, cache_salt), loop, outputs, done))
        self._wakeup.set()
        request_id = await done  # raises the validation error, if any
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect, cancellation)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None, None, None))
        self._wakeup.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    # -- engine thread --------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload, loop, outputs, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(payload)
                self._streams.pop(payload, None)
                continue
            try:
                rid = self.engine.add_request(*payload)
            except Exception as e:  # validation errors go back to the caller
                loop.call_soon_threadsafe(_resolve, done, None, e)
                continue
            self._streams[rid] = (loop, outputs)
            loop.call_soon_threadsafe(_resolve, done, rid, None)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    loop, outputs = stream
                    loop.call_soon_threadsafe(outputs.put_nowait, out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
        except BaseException as e:  # noqa: BLE001 - every open stream must learn about it
            self.error = e
            for loop, outputs in self._streams.values():
                loop.call_soon_threadsafe(outputs.put_nowait, EngineDeadError(f"engine loop died: {e!r}"))
            self._streams.clear()
            raise
        finally:
            self._stopped = True


def _resolve(future: asyncio.Future, value, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
