"""Connections that cannot be held forever: uvicorn's HTTP/1.1 protocol, plus

- a header timeout: a connection must deliver a complete request head within
  --header-timeout of opening (or of its previous response). uvicorn arms its keep-alive
  timer only after a response and cancels it on any byte, so an idle socket that never
  sends, or a slowloris client sending one byte a second, would otherwise stay open forever;
- a connection cap: past --max-connections open connections a new one gets a 503 and is
  closed at once (uvicorn's `limit_concurrency` answers only once a request arrives);
- a response sent before its request's body was read to the end (the 408 of --body-timeout, a
  413) ends the connection: uvicorn would wait for the rest of that body, its keep-alive timer
  cancelled by every byte, so a client sending one byte now and then held it forever. The client
  gets LINGER_S to read the response, then the socket is closed whatever it sends;
- a client that stops reading a response (its socket buffer full) for --body-timeout is
  disconnected: the response can never be delivered, and the connection would stay forever.

The keep-alive idle timeout after a response is uvicorn's `timeout_keep_alive`, and the body
read timeout is the guard middleware's (--body-timeout)."""

from __future__ import annotations

import asyncio
import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from brisk.server.errors import error_body

log = logging.getLogger("brisk.server")


def _raw_response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode() + body


LINGER_S = 2.0


class ReapingH11Protocol(H11Protocol):
    header_timeout_s: float = 15.0
    write_stall_s: float = 30.0
    max_connections: int = 1000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d open, the limit is %d (--max-connections)",
                        len(self.connections) - 1, self.max_connections)
            transport.write(_raw_response(
                503, "Service Unavailable", f"too many open connections (limit {self.max_connections}, "
                f"--max-connections); retry shortly", "too_many_connections", "retry-after: 1\r\n"))
            transport.close()
            return
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request head is complete
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the next request's head must come in time too
        elif self.conn.their_state is h11.SEND_BODY:  # answered before its body ended: this connection is done
            self.loop.call_later(LINGER_S, self._close)

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _write_stalled(self) -> None:
        self._stall_timer = None
        log.info("disconnected a client that read nothing of its response for %g s (--body-timeout)",
                 self.write_stall_s)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().connection_lost(exc)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.transport.write(_raw_response(
            408, "Request Timeout", f"no complete request head within {self.header_timeout_s:g} s "
            f"(--header-timeout)", "header_timeout"))
        self.transport.close()


def uvicorn_config(app, config, host: str, port: int, **kwargs) -> uvicorn.Config:
    """uvicorn settings for a brisk server: the reaping protocol, keep-alive and connection
    limits from the server's config (a `ServerConfig`)."""
    protocol = type("BriskH11Protocol", (ReapingH11Protocol,), {
        "header_timeout_s": config.header_timeout_s, "write_stall_s": config.body_timeout_s,
        "max_connections": config.max_connections})
    # uvicorn answers 503 once connections (the asking one included) reach limit_concurrency: + 1, so
    # every one of the --max-connections connections this protocol admits can be served
    return uvicorn.Config(app, host=host, port=port, http=protocol, timeout_keep_alive=config.keep_alive_s,
                          limit_concurrency=config.max_connections + 1, lifespan="on", access_log=False, **kwargs)
