"""Running one HTTP request's engine requests and answering: admission, one ordered stream of
every choice's outputs, the request timeout, and an end that always comes (a client that leaves
aborts its requests, a timeout or a shutdown ends them with an error event, a dead engine ends
every open stream). What happens once a run is over (metrics, trace, request log, access line) is
`brisk.server.run_record.RunRecord`'s job."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from brisk.engine.errors import EngineDeadError, RequestFailedError
from brisk.engine.outputs import RequestOutput
from brisk.engine.sampling_params import SamplingParams
from brisk.server.context_guard import combined_headers
from brisk.server.errors import APIError
from brisk.server.prepare import Prepared
from brisk.server.responses import usage_block
from brisk.server.run_record import RunRecord
from brisk.server.state import RequestTimeoutError, ServerState, ShutdownError

log = logging.getLogger("brisk.server")

_DISCONNECT_POLL_S = 0.2


class Job(NamedTuple):
    """One engine request of an HTTP request: a choice of a prompt."""

    index: int  # the choice's index in the response
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


class ClientDisconnected(Exception):
    pass


def jobs_of(prepared: Prepared, n: int) -> list[Job]:
    jobs = []
    for p_index, guard in enumerate(prepared.guards):
        base = prepared.params[p_index] if isinstance(prepared.params, list) else prepared.params
        jobs.extend(Job(p_index * n + i, p_index, guard.prompt_ids, base.for_choice(i)) for i in range(n))
    return jobs


async def respond(state: ServerState, engine, raw: Request, body, prepared: Prepared):
    """Admit, start one engine request per (prompt, choice), then stream or collect. `engine` is
    the one the route checked (state.require_engine) before preparing the request."""
    jobs = jobs_of(prepared, body.n)
    state.admit(len(jobs))
    guards = prepared.guards
    for g in guards:
        state.metrics.context_guard.labels(g.outcome).inc()
    headers = combined_headers(guards)
    run = Run(state, engine, prepared, jobs, body, RunRecord(state, raw, body, prepared, jobs))
    try:
        await run.start()
    except BaseException:
        run.close()
        raise
    for g in guards:
        state.metrics.prompt_tokens.inc(g.prompt_tokens)
    if body.stream:
        return RunStream(run, headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        result = await _until_disconnect(raw, run.collect())
    except ClientDisconnected:
        log.info("client disconnected before the response of %s; its %d engine request(s) were aborted",
                 run.fmt.id, len(jobs) - len(run.finals))
        return Response(status_code=499)  # nobody is listening; the engine requests are aborted
    finally:
        run.close()
    return JSONResponse(result, headers={**headers, "server-timing": run.server_timing()})


class RunStream(StreamingResponse):
    """Server-sent events of a run; the run is closed (engine requests aborted, admission slot
    freed) however the response ends — even if the client left before the first byte."""

    def __init__(self, run: "Run", headers: dict[str, str]):
        super().__init__(run.sse(), media_type="text/event-stream", headers=headers)
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


async def _until_disconnect(raw: Request, coro):
    """Await `coro`, cancelling it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancelled on purpose
                pass
            raise ClientDisconnected()


class Run:
    """The engine requests behind one HTTP request, merged into one ordered output stream."""

    def __init__(self, state: ServerState, engine, prepared: Prepared, jobs: list[Job], body, record: RunRecord):
        self.state, self.engine, self.jobs, self.body, self.record = state, engine, jobs, body, record
        self.fmt, self.guards = prepared.fmt, prepared.guards
        self.started = False
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice index, output or failure), every choice's
        self.streams: dict[int, Any] = {}  # choice index -> its engine request's handle
        self.finals: dict[int, RequestOutput] = {}
        self.generated: dict[int, int] = {}  # tokens streamed so far per choice (the trace of an abort)
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.abort_cause = "client_disconnect"

    async def start(self) -> None:
        """Add every engine request (validation errors surface here, before any response)."""
        priority = self.body.priority if self.state.config.allow_priority else 0
        for job in self.jobs:
            try:
                self.streams[job.index] = await self.engine.add(
                    job.prompt_ids, job.params, request_id=f"{self.fmt.id}-{job.index}", priority=priority,
                    cache_salt=self.body.cache_salt, sink=(self.queue, job.index))
            except Exception as e:
                for stream in self.streams.values():
                    stream.close()
                if isinstance(e, EngineDeadError):
                    raise APIError(503, f"engine unavailable: {e}", code="engine_dead") from None
                if isinstance(e, ValueError):
                    raise APIError(400, str(e), param=getattr(e, "field", None), code="invalid_value") from None
                raise
        self.started = True
        if self.state.config.request_timeout_s is not None:
            self.timer = asyncio.get_running_loop().call_later(self.state.config.request_timeout_s, self._timeout)

    def _timeout(self) -> None:
        self.abort_cause = "timeout"
        error = RequestTimeoutError(f"the request ran past the server's --request-timeout "
                                    f"({self.state.config.request_timeout_s:g} s)")
        for job in self.jobs:
            self.engine.fail(f"{self.fmt.id}-{job.index}", error)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.jobs)
        while remaining:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):  # the engine already dropped this request
                self.streams[index].mark_done()
                raise item
            self.record.delivered(item)
            self.generated[index] = self.generated.get(index, 0) + len(item.delta_token_ids)
            if item.error is not None:  # this choice failed by itself: the engine freed it and went on
                self.streams[index].mark_done()
                self.record.failed(item)
                raise RequestFailedError(item.request_id, *item.error)
            if item.finished:
                remaining -= 1
                self.streams[index].mark_done()
                self.finals[index] = item
                self.record.finished(item)
            yield index, item

    async def collect(self) -> dict[str, Any]:
        try:
            async for index, out in self.outputs():
                self.fmt.observe(index, out)
        except asyncio.CancelledError:  # the client left (see _until_disconnect): not an error
            raise
        except BaseException as e:
            raise self._api_error(e) from None
        return self.fmt.full_response(self.finals, self.jobs, self.guards, self.usage())

    async def sse(self) -> AsyncIterator[str]:
        fmt = self.fmt
        try:
            for chunk in fmt.first_chunks(self.jobs, self.guards):
                yield fmt.encode(chunk)
            async for index, out in self.outputs():
                chunks = fmt.chunks(index, out, self.body)
                for chunk in chunks:
                    yield fmt.encode(chunk)
                if chunks:  # resumed: the server wrote the chunk to the socket
                    self.record.written(out)
            for chunk in fmt.last_chunks(self.body, self.usage()):
                yield fmt.encode(chunk)
            if fmt.done_marker:
                yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream must end with an error event, not hang
            for event in fmt.error_events(self._api_error(e)):
                yield event
            if fmt.done_marker:
                yield "data: [DONE]\n\n"
        finally:
            self.close()

    def usage(self) -> dict[str, Any]:
        return usage_block(self.finals, self.guards, self.jobs)

    def server_timing(self) -> str:
        first = self.finals.get(0)
        if first is None:
            return ""
        m = first.metrics
        parts = [f"{name};dur={m[key]:.1f}" for name, key in
                 (("queue", "queue_ms"), ("prefill", "prefill_ms"), ("decode", "decode_ms"), ("ttft", "ttft_ms"))
                 if m.get(key) is not None]
        return ", ".join(parts)

    def close(self) -> None:
        """Idempotent: abort the unfinished engine requests, free the slot, record the run."""
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        for stream in self.streams.values():
            stream.close()  # aborts it unless its final output or failure arrived
        self.state.release(len(self.jobs))
        unfinished = len(self.jobs) - len(self.finals)
        self.record.closed(self.finals, self.generated, unfinished, self.started, self.abort_cause, self.usage())

    def _api_error(self, e: BaseException) -> APIError:
        error, cause = as_api_error(e, self.fmt.id)
        if cause is not None:
            self.abort_cause = cause
        return error


def as_api_error(e: BaseException, request_id: str) -> tuple[APIError, str | None]:
    """The error a client gets for a run that failed, and the abort cause it is counted under
    (None: leave the cause as it is)."""
    if isinstance(e, APIError):  # a Ray replica that died serving it is not the client's doing
        return e, "replica_lost" if e.code == "replica_lost" else None
    if isinstance(e, RequestTimeoutError):
        return APIError(504, str(e), code="timeout"), "timeout"
    if isinstance(e, ShutdownError):
        return APIError(503, str(e), code="shutting_down"), "shutdown"
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine stopped: {e}; restart the server", code="engine_dead"), "engine_error"
    if isinstance(e, RequestFailedError):  # logged once, with its traceback, where it happened
        # a grammar the model's vocabulary cannot meet is the request's to change; the rest are ours
        status = 400 if e.reason == "grammar_unsatisfiable" else 500
        return APIError(status, e.message, param=e.param, code=e.reason), "request_error"
    log.exception("request %s failed", request_id, exc_info=e)
    return APIError(500, f"internal server error in request {request_id}; the server log has the details",
                    code="internal_error"), "error"

