"""Timed HTTP requests for `brisk doctor`: DNS, TCP connect, TLS, time to first byte, time
to first token, chunk arrival times, and whether the connection was reused — from httpx's
trace hooks, so the client's view of every request can be split into network and server."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from brisk.bench.client import chunk_content, error_message
from brisk.errors import BriskError


@dataclass
class Timing:
    status: int | None = None
    connect_s: float = 0.0
    tls_s: float = 0.0
    ttfb_s: float | None = None  # request sent -> response headers
    ttft_s: float | None = None  # request sent -> first content-bearing chunk
    e2e_s: float | None = None
    chunk_ts: list[float] = field(default_factory=list)  # seconds from send, content-bearing chunks
    reused_connection: bool = True
    usage: dict[str, Any] | None = None
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def prompt_tokens(self) -> int | None:
        return (self.usage or {}).get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return (self.usage or {}).get("completion_tokens")


def dns_seconds(url: str) -> float | None:
    host = urlparse(url).hostname
    if host is None:
        return None
    start = time.perf_counter()
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return None
    return time.perf_counter() - start


class Prober:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.client.close()

    def _trace(self, timing: Timing, start: float):
        marks: dict[str, float] = {}

        def hook(event: str, info: dict) -> None:
            now = time.perf_counter()
            marks[event] = now
            if event == "connection.connect_tcp.complete":
                timing.reused_connection = False
                timing.connect_s = now - marks.get("connection.connect_tcp.started", start)
            elif event == "connection.start_tls.complete":
                timing.tls_s = now - marks.get("connection.start_tls.started", now)
            elif event.endswith("receive_response_headers.complete") and timing.ttfb_s is None:
                timing.ttfb_s = now - start

        return hook

    def get(self, path: str, timeout_s: float | None = None) -> Timing:
        timing = Timing()
        start = time.perf_counter()
        try:
            resp = self.client.get(path, extensions={"trace": self._trace(timing, start)},
                                   **_timeout(timeout_s))
            timing.status, timing.e2e_s = resp.status_code, time.perf_counter() - start
            timing.headers = dict(resp.headers)
            try:
                timing.body = resp.json()
            except ValueError:
                timing.body = resp.text
        except httpx.HTTPError as e:
            _failed(timing, e, self.base_url)
        return timing

    def post_json(self, path: str, body: dict, timeout_s: float | None = None) -> Timing:
        timing = Timing()
        start = time.perf_counter()
        try:
            resp = self.client.post(path, json=body, extensions={"trace": self._trace(timing, start)},
                                    **_timeout(timeout_s))
            timing.status, timing.e2e_s = resp.status_code, time.perf_counter() - start
            timing.headers = dict(resp.headers)
            try:
                timing.body = resp.json()
            except ValueError:
                timing.body = resp.text[:2000]
            if isinstance(timing.body, dict):
                timing.usage = timing.body.get("usage")
        except httpx.HTTPError as e:
            _failed(timing, e, self.base_url)
        return timing

    def stream_chat(self, model: str, messages: list[dict], max_tokens: int, extra: dict | None = None,
                    timeout_s: float | None = None) -> Timing:
        """A streamed chat completion with usage; chunk arrival times relative to the send. With
        `timeout_s`, the whole response must arrive within it (else timed_out, and we hang up)."""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0, **(extra or {})}
        timing = Timing()
        start = time.perf_counter()
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body, **_timeout(timeout_s),
                                    extensions={"trace": self._trace(timing, start)}) as resp:
                timing.status = resp.status_code
                timing.headers = dict(resp.headers)
                if resp.status_code != 200:
                    resp.read()
                    timing.error = f"HTTP {resp.status_code}: {error_message(resp.text)}"
                    timing.e2e_s = time.perf_counter() - start
                    return timing
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._chunk(timing, json.loads(data), time.perf_counter() - start)
                    if timing.error:
                        break
                    if timeout_s is not None and time.perf_counter() - start > timeout_s:
                        timing.timed_out = True
                        timing.error = f"no complete answer within {timeout_s:.1f} s"
                        break
            timing.e2e_s = time.perf_counter() - start
            if timing.chunk_ts:
                timing.ttft_s = timing.chunk_ts[0]
        except httpx.HTTPError as e:
            _failed(timing, e, self.base_url)
        except json.JSONDecodeError as e:
            timing.error = f"bad stream: {e}"
        return timing

    @staticmethod
    def _chunk(timing: Timing, chunk: dict, at: float) -> None:
        text, usage, error = chunk_content(chunk, chat=True)
        if error:
            timing.error = f"stream error: {error}"
            return
        if text:
            timing.chunk_ts.append(at)
            timing.text += text
        if usage:
            timing.usage = usage


def _timeout(timeout_s: float | None) -> dict:
    return {} if timeout_s is None else {"timeout": httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))}


def _failed(timing: Timing, e: httpx.HTTPError, url: str) -> None:
    timing.error = describe(e, url)
    timing.timed_out = isinstance(e, httpx.TimeoutException)


def describe(e: httpx.HTTPError, url: str) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, httpx.ConnectError) and ("SSL" in text or "certificate" in text.lower()):
        return f"TLS handshake with {url} failed ({text[:200]})"
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect to {url} ({text[:200]})"
    if isinstance(e, httpx.TimeoutException):
        return f"timed out talking to {url} ({type(e).__name__})"
    return f"{type(e).__name__}: {text[:200]}"


def require_openai(prober: Prober) -> dict:
    """GET /v1/models, or one clear error saying why this is not a usable endpoint."""
    models = prober.get("/v1/models")
    if models.error:
        raise BriskError(f"{models.error}; check the URL and that the server is running")
    if models.status == 401:
        raise BriskError(f"{prober.base_url} answered 401 Unauthorized: pass --api-key (or set OPENAI_API_KEY)")
    if models.status == 404:
        raise BriskError(f"{prober.base_url}/v1/models is 404: not an OpenAI-compatible API "
                         "(give the base URL, without /v1)")
    body = models.body
    if models.status == 200 and not (isinstance(body, dict) and isinstance(body.get("data"), list)):
        raise BriskError(f"{prober.base_url}/v1/models did not return an OpenAI model list; "
                         "is this an OpenAI-compatible server?")
    return {"status": models.status, "body": body, "headers": models.headers}
