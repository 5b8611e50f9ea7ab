"""One pure-ASGI middleware for what every request passes through: the API key (one rule
for every route but /health and /ready, and /metrics with --metrics-public), the
request-body size and read-time limits, the HTTP-status counter, and the access-log line."""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from starlette.exceptions import HTTPException

from brisk.server.errors import error_body
from brisk.server.logs import access_line, access_log

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/tokenize",
           "/detokenize", "/health", "/ready", "/metrics", "/", "/v1/brisk/engine"}
PUBLIC_PATHS = frozenset({"/health", "/ready"})  # probes: a load balancer has no key


def key_matches(authorization: bytes, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared as bytes in constant time (a key is UTF-8;
    a header is bytes, so a non-ASCII key matches when the client sends it as UTF-8)."""
    if authorization[:7].lower() != b"bearer ":
        return False
    return hmac.compare_digest(authorization[7:].strip(), key.encode("utf-8"))


class GuardMiddleware:
    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        status_holder = {"status": 500}
        start = time.perf_counter()

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
            await send(message)

        try:
            rejection = self._reject(scope, path)
            if rejection is not None:
                status, body, headers = rejection
                await _send_json(counting_send, status, body, headers)
                return
            await self.app(scope, self._limited(receive), counting_send)
        finally:
            self.state.metrics.http_responses.labels(route, str(status_holder["status"])).inc()
            if self.state.config.log_requests:
                access_log.info("%s", access_line(scope, status_holder["status"],
                                                  (time.perf_counter() - start) * 1e3, self.state.config.log_prompts))

    def _needs_key(self, path: str) -> bool:
        config = self.state.config
        if not config.api_key or path in PUBLIC_PATHS:
            return False
        return not (path == "/metrics" and config.metrics_public)

    def _reject(self, scope, path: str):
        headers = dict(scope.get("headers") or [])
        if self._needs_key(path):
            auth = headers.get(b"authorization", b"")
            if path == "/" and not auth:  # a browser opening the page sends no header: /?key=KEY
                auth = b"Bearer " + _query_key(scope)
            if not key_matches(auth, self.state.config.api_key):
                message = ("missing API key: send the header `Authorization: Bearer <key>`" if not auth
                           else "incorrect API key provided")
                return 401, error_body(401, message, code="invalid_api_key"), {"www-authenticate": "Bearer"}
        length = headers.get(b"content-length")
        limit = self.state.config.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return 413, error_body(413, _too_large(int(length), limit), code="request_too_large"), {}
        return None

    def _limited(self, receive):
        limit = self.state.config.max_request_bytes
        timeout = self.state.config.body_timeout_s
        deadline = time.monotonic() + timeout
        received = 0
        body_done = False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # after the body: only a disconnect can come, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:  # a slow client (slowloris) holding a connection and a task
                raise HTTPException(408, f"the request body did not arrive within {timeout:g} s "
                                         f"(--body-timeout); send it at once") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body with no (or a false) content-length
                    raise HTTPException(413, _too_large(received, limit))
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        return limited_receive


def _query_key(scope) -> bytes:
    """The `key` parameter of the query string (the page's way to carry the API key)."""
    from urllib.parse import parse_qs

    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key")
    return values[0].encode("utf-8") if values else b""


def _too_large(size: int, limit: int) -> str:
    return f"request body of {size} bytes exceeds the limit of {limit} bytes (--max-request-bytes)"


async def _send_json(send, status: int, body: dict, headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
