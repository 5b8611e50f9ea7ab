"""A streaming OpenAI-API load client: one RequestRecord per request, timestamps taken
as chunks arrive, token counts from the server's `usage` (stream_options.include_usage).
It also watches its own event loop, so a client-bound run is reported as such."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from brisk.bench.metrics import RequestRecord
from brisk.loop_lag import LoopLagMonitor


@dataclass
class BenchRequest:
    messages: list[dict[str, Any]] | None = None  # chat; else `prompt` on /v1/completions
    prompt: str | list[int] | None = None
    max_tokens: int = 64
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. {"ignore_eos": True}


async def send_streaming(http: httpx.AsyncClient, model: str, req: BenchRequest) -> RequestRecord:
    chat = req.messages is not None
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, **req.extra}
    body["messages" if chat else "prompt"] = req.messages if chat else req.prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    record = RequestRecord(sent_ts=time.perf_counter())
    try:
        async with http.stream("POST", path, json=body) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                record.error = f"HTTP {resp.status_code}: {error_message(resp.text)}"
                return record
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                _consume_chunk(record, json.loads(data), chat)
                if record.error:
                    return record
        if not done:  # the server closed the stream early: a failure, however much text came
            record.error = "stream ended without data: [DONE]"
            return record
        record.end_ts = record.chunk_ts[-1] if record.chunk_ts else time.perf_counter()
        if record.output_tokens is None:  # no usage from this server: count content chunks
            record.output_tokens = len(record.chunk_ts)
        if not record.chunk_ts and req.max_tokens > 0:
            record.error = "the response carried no generated text"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"[:200]
    return record


def chunk_content(chunk: dict[str, Any], chat: bool) -> tuple[str, dict[str, Any] | None, str | None]:
    """One parsed SSE chunk of an OpenAI stream -> (generated text, usage if present, error if any)."""
    if "error" in chunk:
        return "", None, error_message(json.dumps(chunk))
    text = ""
    for choice in chunk.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        text += piece or ""
    return text, chunk.get("usage") or None, None


def _consume_chunk(record: RequestRecord, chunk: dict[str, Any], chat: bool) -> None:
    now = time.perf_counter()
    text, usage, error = chunk_content(chunk, chat)
    if error:
        record.error = f"stream error: {error}"
        return
    if text:
        record.chunk_ts.append(now)
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")
        record.server_timings = usage.get("brisk")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]


def error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"][:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def run_concurrency(base_url: str, model: str, requests: list[BenchRequest], concurrency: int,
                          api_key: str | None = None, timeout_s: float = 600.0,
                          monitor: LoopLagMonitor | None = None) -> list[RequestRecord]:
    """Keep `concurrency` requests in flight until all are done; records in request order."""
    return await run_schedule(base_url, model, requests, max_concurrency=concurrency, api_key=api_key,
                              timeout_s=timeout_s, monitor=monitor)


async def run_schedule(base_url: str, model: str, requests: list[BenchRequest], *,
                       arrivals: list[float] | None = None, max_concurrency: int | None = None,
                       duration_s: float | None = None, api_key: str | None = None, timeout_s: float = 600.0,
                       monitor: LoopLagMonitor | None = None,
                       on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
    """Send `requests` at `arrivals` (seconds from start; None = as fast as the concurrency cap
    allows), at most `max_concurrency` in flight, issuing none after `duration_s`.
    Returns the records of the requests sent, in request order."""
    if max_concurrency is None and arrivals is None:
        raise ValueError("give a concurrency cap, arrival times, or both")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    cap = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    records: list[RequestRecord | None] = [None] * len(requests)
    gate = asyncio.Semaphore(cap)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=30)) as http:
        async def one(i: int, due: float) -> None:
            try:
                records[i] = await send_streaming(http, model, requests[i])
                records[i].due_ts = due
                if on_done is not None:
                    on_done(records[i])
            finally:
                gate.release()

        if monitor is not None:
            monitor.start()
        start = time.perf_counter()
        tasks = []
        try:
            for i in range(len(requests)):
                if arrivals is not None:
                    delay = start + arrivals[i] - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                due = start + (arrivals[i] if arrivals is not None else 0.0)
                await gate.acquire()
                if duration_s is not None and time.perf_counter() - start > duration_s:
                    gate.release()
                    break
                tasks.append(asyncio.create_task(one(i, due)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if monitor is not None:
                monitor.stop()
    return [r for r in records if r is not None]
