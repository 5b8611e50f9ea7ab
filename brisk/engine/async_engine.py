"""Async front of the engine: `generate()` yields RequestOutputs as tokens arrive,
`abort()` stops a request, `fail()` stops it and raises an error in its consumer.

The step loop runs in a background thread, so the event loop stays responsive; every
engine mutation happens on that thread (requests, aborts and stats queries are handed
over through a queue and applied before the next step). No consumer is ever left
waiting: when the loop dies or shuts down, every open stream and every pending
command gets an `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from typing import Any, AsyncIterator

from brisk import switches
from brisk.engine.client import ModelInfo
from brisk.engine.engine import LLMEngine
from brisk.engine.errors import EngineDeadError
from brisk.engine.outputs import RequestOutput
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.stats import EngineStats
from brisk.engine.stream import RequestStream

log = logging.getLogger("brisk.engine")


def engine_niceness_from_env() -> int:
    return switches.integer("BRISK_ENGINE_NICENESS")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, engine_niceness: int | None = None):
        self.engine = engine
        self.engine_niceness = engine_niceness_from_env() if engine_niceness is None else engine_niceness
        self._commands: queue.Queue = queue.Queue()
        # request id -> (its consumer's loop, the queue its outputs go to, the tag they carry)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="brisk-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return not self._stopped and self.error is None

    # -- what a server needs to know of the engine (brisk.engine.client.EngineClient) -------------
    @property
    def model_info(self) -> ModelInfo:
        loaded = self.engine.loaded
        return ModelInfo(str(loaded.dtype).split(".")[-1], str(loaded.device), dict(loaded.report.phases_ms),
                         loaded.report.total_ms, loaded.config.architecture)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def pooling(self):
        return self.engine.loaded.pooling

    @property
    def vocab_size(self) -> int:
        return self.engine.loaded.config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler_config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler_config.max_num_seqs

    # -- public API (event-loop side) ----------------------------------------
    async def add(self, prompt: str | list[int], params: SamplingParams | None = None,
                  request_id: str | None = None, priority: int = 0,
                  cache_salt: str | None = None, sink: tuple[asyncio.Queue, Any] | None = None) -> "RequestStream":
        """Add a request (raising its validation error here) and return its output stream.

        With `sink` = (queue, tag), the outputs (and a failure, as an exception) go straight into
        that queue as (tag, item) pairs instead: one queue can merge several requests (the `n`
        choices of an HTTP request) with no task per request in between. The returned stream is
        then only the handle to close (abort) it; call `mark_done()` once its final item arrived."""
        outputs: asyncio.Queue = asyncio.Queue() if sink is None else sink[0]
        tag = _UNTAGGED if sink is None else sink[1]
        request_id = await self._call("add", (prompt, params, request_id, priority, cache_salt), (outputs, tag))
        return RequestStream(self, request_id, outputs)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add(prompt, params, request_id, priority, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:  # the consumer went away (client disconnect, cancellation) or failed
            stream.close()

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks before the next step; safe from any thread."""
        self._commands.put(("abort", request_id, None, None))
        self._wakeup.set()

    def fail(self, request_id: str, error: BaseException) -> None:
        """Abort a request and raise `error` in its consumer (timeouts, shutdown)."""
        self._commands.put(("fail", (request_id, error), None, None))
        self._wakeup.set()

    def fail_all(self, error: BaseException) -> None:
        self._commands.put(("fail_all", error, None, None))
        self._wakeup.set()

    async def stats(self) -> EngineStats:
        """A consistent snapshot, taken on the engine thread between steps."""
        return await self._call("stats", None, None)

    async def block_map(self) -> dict:
        """The KV pool's picture (LLMEngine.block_map), taken on the engine thread between steps."""
        return await self._call("block_map", None, None)

    async def stats_by_replica(self) -> None:
        return None  # one engine, in this process

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    async def _call(self, kind: str, payload: Any, outputs: tuple[asyncio.Queue, Any] | None):
        if not self.is_alive:
            raise self._dead_error()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put((kind, payload, outputs, (loop, done)))
        self._wakeup.set()
        if not self.is_alive:  # died between the check and the put: nobody will read the queue
            self._drain_commands()
        return await done

    def _dead_error(self) -> EngineDeadError:
        if self.error is not None:
            return EngineDeadError(f"engine loop died: {self.error!r}")
        return EngineDeadError("engine is shut down")

    def busy(self) -> bool:
        """Requests in flight or on their way in (read from any thread: background work yields to them)."""
        return bool(self._streams) or not self._commands.empty() or self.engine.has_unfinished_requests()

    # -- engine thread --------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload, outputs, reply = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(payload)
                self._streams.pop(payload, None)
            elif kind == "fail":
                self._fail(*payload)
            elif kind == "fail_all":
                for request_id in list(self._streams):
                    self._fail(request_id, payload)
            elif kind == "stats":
                _reply(reply, self.engine.stats(), None)
            elif kind == "block_map":
                _reply(reply, self.engine.block_map(), None)
            elif kind == "add":
                try:
                    rid = self.engine.add_request(*payload)
                except Exception as e:  # validation errors go back to the caller
                    _reply(reply, None, e)
                    continue
                self._streams[rid] = (reply[0], *outputs)
                _reply(reply, rid, None)

    def _fail(self, request_id: str, error: BaseException) -> None:
        self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            loop, outputs, tag = stream
            loop.call_soon_threadsafe(_deliver, [(outputs, tag, error)])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their event loops: one wake-up per loop per step, not one per
        output (each `call_soon_threadsafe` writes to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any, RequestOutput]]] = {}
        now = time.monotonic()
        for out in outputs:
            out.produced_at = now
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            loop, queue_, tag = stream
            by_loop.setdefault(loop, []).append((queue_, tag, out))
            if out.finished:
                self._streams.pop(out.request_id, None)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _run(self) -> None:
        _yield_cpu_to_io(self.engine_niceness)
        try:
            while not self._stopped:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                self._publish(self.engine.step())
        except BaseException as e:  # noqa: BLE001 - every open stream must learn about it
            log.exception("engine loop died")
            self.error = e
        finally:
            self._stopped = True
            error = self._dead_error()
            for loop, outputs, tag in self._streams.values():
                loop.call_soon_threadsafe(_deliver, [(outputs, tag, error)])
            self._streams.clear()
            self._drain_commands()
            try:
                self.engine.close()  # the disk tier writes what it has queued
            except Exception:  # noqa: BLE001 - shutting down: say it, end anyway
                log.exception("closing the engine failed")

    def _drain_commands(self) -> None:
        """Answer every queued command with the death error (the loop will never read them)."""
        error = self._dead_error()
        while True:
            try:
                _, _, _, reply = self._commands.get_nowait()
            except queue.Empty:
                return
            if reply is not None:
                _reply(reply, None, error)


def _reply(reply: tuple[asyncio.AbstractEventLoop, asyncio.Future], value, error) -> None:
    loop, future = reply
    loop.call_soon_threadsafe(_resolve, future, value, error)


def _yield_cpu_to_io(niceness: int) -> None:
    """Lower this (engine) thread's CPU priority; the OpenMP workers torch starts from it inherit it.

    NOTE: on a small CPU the engine's compute threads occupy every core during a forward, and the
    event loop that streams tokens and admits requests waits for a time slice: measured at 64
    streams on 2 cores, tokens reached the client up to 480 ms after the engine produced them.
    With the engine niced, the event loop's short bursts run as soon as they are ready. Linux
    only (per-thread niceness); raising niceness needs no privilege. 0 turns it off."""
    if niceness <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
    except OSError as e:
        log.warning("could not lower the engine thread's priority: %s", e)


_UNTAGGED = object()  # a stream's own queue: items go in bare, not as (tag, item)


def _deliver(items: list[tuple[asyncio.Queue, Any, RequestOutput | BaseException]]) -> None:
    for queue_, tag, item in items:
        queue_.put_nowait(item if tag is _UNTAGGED else (tag, item))


def _resolve(future: asyncio.Future, value, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)

