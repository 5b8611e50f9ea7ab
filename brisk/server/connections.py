"""Connections that cannot be held forever: uvicorn's HTTP/1.1 protocol, plus

- a header timeout: a connection must deliver a complete request head within
  --header-timeout of opening, and a later request's head within --header-timeout of its
  first byte. uvicorn arms its keep-alive timer only after a response and cancels it on any
  byte, so an idle socket that never sends, or a slowloris client sending one byte a second,
  would otherwise stay open forever. Between requests an idle connection is closed by the
  keep-alive timer alone (see `uvicorn_config` for why that one is long);
- a connection cap: past --max-connections open connections, the oldest connection idle
  between requests is closed to make room; when none is idle, the new one gets a 503 and is
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
        self._idle_since: float | None = None  # between requests, waiting for the next one
        if len(self.connections) > self.max_connections and not self._close_oldest_idle():
            log.warning("refused a connection: %d open, the limit is %d (--max-connections)",
                        len(self.connections) - 1, self.max_connections)
            transport.write(_raw_response(
                503, "Service Unavailable", f"too many open connections (limit {self.max_connections}, "
                f"--max-connections); retry shortly", "too_many_connections", "retry-after: 1\r\n"))
            transport.close()
            return
        self._arm_header_timer()

    def _close_oldest_idle(self) -> bool:
        """At the cap, a keep-alive connection idle between requests makes room for a new one
        (as nginx does): the oldest idle one is closed, and its client opens a new one when it
        needs it. False when every connection is busy."""
        idle = [c for c in self.connections if isinstance(c, ReapingH11Protocol) and c._idle_since is not None
                and not c.transport.is_closing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since)
        log.info("closed a connection idle for %.1f s to admit a new one (--max-connections %d)",
                 self.loop.time() - oldest._idle_since, self.max_connections)
        oldest._close()
        return True

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request head is complete
            self._cancel_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._arm_header_timer()  # a later request's first bytes: the rest of its head must come in time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            if self.conn.trailing_data[0]:  # part of a pipelined head came during the response
                self._arm_header_timer()
            else:  # idle: uvicorn's keep-alive timer closes it (a header timer here would race the
                self._idle_since = self.loop.time()  # clients' own pool expiry, as 5 s of keep-alive did)
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
    limits from the server's config (a `ServerConfig`).

    The keep-alive default (75 s, nginx's) is longer than the idle expiry of the pools clients
    use (httpx and the openai SDK: 5 s, aiohttp: 15 s, undici: 4 s), so the client drops an idle
    connection before the server closes it. With both at 5 s (uvicorn's and vLLM's default), a
    request sent at 5 s of idle crossed the server's close and failed with "connection reset" or
    "server disconnected" (seen in the test suite; with both at 0.5 s, 8 of 150 requests sent
    within 4 ms of the expiry failed so)."""
    protocol = type("BriskH11Protocol", (ReapingH11Protocol,), {
        "header_timeout_s": config.header_timeout_s, "write_stall_s": config.body_timeout_s,
        "max_connections": config.max_connections})
    # uvicorn answers 503 once connections (the asking one included) reach limit_concurrency: + 1, so
    # every one of the --max-connections connections this protocol admits can be served
    return uvicorn.Config(app, host=host, port=port, http=protocol, timeout_keep_alive=config.keep_alive_s,
                          limit_concurrency=config.max_connections + 1, lifespan="on", access_log=False, **kwargs)
