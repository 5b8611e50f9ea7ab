"""One pure-ASGI middleware for what every request passes through: the API key on /v1/*,
the request-body size limit, and the HTTP-status counter."""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException

from brisk.server.errors import error_body

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
           "/ready", "/metrics"}


class GuardMiddleware:
    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        status_holder = {"status": 500}

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

    def _reject(self, scope, path: str):
        headers = dict(scope.get("headers") or [])
        key = self.state.config.api_key
        if key and path.startswith("/v1/"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                message = ("missing API key: send the header `Authorization: Bearer <key>`" if not token
                           else "incorrect API key provided")
                return 401, error_body(401, message, code="invalid_api_key"), {"www-authenticate": "Bearer"}
        length = headers.get(b"content-length")
        limit = self.state.config.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return 413, error_body(413, _too_large(int(length), limit), code="request_too_large"), {}
        return None

    def _limited(self, receive):
        limit = self.state.config.max_request_bytes
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body with no (or a false) content-length
                    raise HTTPException(413, _too_large(received, limit))
            return message

        return limited_receive


def _too_large(size: int, limit: int) -> str:
    return f"request body of {size} bytes exceeds the limit of {limit} bytes (--max-request-bytes)"


async def _send_json(send, status: int, body: dict, headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
