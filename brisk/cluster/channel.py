"""The output channel: replicas send generated tokens to the ingress over one TCP connection per
(replica, ingress) pair, instead of one Ray streaming-generator message per token and request.

Requests still go through Ray Serve: the handle call routes them (brisk.cluster.router), carries
the accept/refuse answer, counts towards Serve's ongoing requests (autoscaling, load balance), and
raises in the ingress when the replica dies. Only the outputs take the channel. Measured on 2
cores (benchmarks/scale_out.py): a Ray message per token cost the replica's and the ingress's Ray
threads ~15% of the CPU at one stream, and one message per stream per step at 16 streams; the
channel sends one frame per engine step for all the streams of one ingress.

Direction and trust: the ingress listens (`OutputListener`, on 127.0.0.1 for a local Ray instance,
else on its node's address) and passes (host, port, key) with every request; a replica connects
once per ingress (`ChannelClient`) and first sends the key, a random 128-bit secret that travels
only inside Ray's own calls. A connection that does not present it within HELLO_TIMEOUT_S is
closed before anything is unpickled.

Frames: a 4-byte big-endian length, then a pickled list of (request_id, item); item is a list of
RequestOutputs or an `EngineDead` (brisk/cluster/messages.py) when the replica's engine loop stopped.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import struct
from typing import Any, Callable

log = logging.getLogger("brisk.cluster")

HELLO_TIMEOUT_S = 10.0
HELLO_MAX_BYTES = 64  # the key: a peer that has not presented it gets nothing buffered for it
MAX_FRAME_BYTES = 256 << 20
_LENGTH = struct.Struct(">I")


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    limit = MAX_FRAME_BYTES if limit is None else limit
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > limit:
        raise ValueError(f"output channel frame of {size} bytes (limit {limit})")
    return await reader.readexactly(size)


class OutputListener:
    """The ingress's end. `deliver(request_id, item)` is called on the event loop for every item and
    says whether that request is still open; `lost(request_ids, message)` gets the open requests a
    broken connection was carrying."""

    def __init__(self, host: str, deliver: Callable[[str, Any], bool], lost: Callable[[list[str], str], None]):
        self.host = host
        self.key = secrets.token_hex(16)
        self._deliver = deliver
        self._lost = lost
        self._server: asyncio.AbstractServer | None = None
        self._starting = asyncio.Lock()  # binds to a loop on first use (Python >= 3.10)
        self.port: int | None = None

    async def address(self) -> tuple[str, int, str]:
        """(host, port, key) for a request's replica; starts listening on first use."""
        if self._server is None:
            async with self._starting:
                if self._server is None:
                    self._server = await asyncio.start_server(self._serve, self.host, 0)
                    self.port = self._server.sockets[0].getsockname()[1]
                    log.info("replica outputs arrive on %s:%d", self.host, self.port)
        return self.host, self.port, self.key

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        carried: set[str] = set()  # requests this connection sent outputs for and did not finish
        try:
            hello = await asyncio.wait_for(_read_frame(reader, HELLO_MAX_BYTES), HELLO_TIMEOUT_S)
            if not hmac.compare_digest(hello, self.key.encode()):
                log.warning("output channel: %s did not present the key; closed", peer)
                return
            while True:
                for request_id, item in pickle.loads(await _read_frame(reader)):
                    if self._deliver(request_id, item):  # still open
                        carried.add(request_id)
                    else:
                        carried.discard(request_id)
        except asyncio.CancelledError:
            # the ingress is shutting down and its loop cancels the handlers: end quietly (a cancelled
            # handler task is logged as an error by asyncio's streams on Python 3.11)
            return
        except Exception as e:  # noqa: BLE001 - EOF, reset, timeout, a bad frame: its open requests end
            if not isinstance(e, (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, ValueError)):
                log.error("output channel from %s failed", peer, exc_info=e)
            if carried:
                self._lost(sorted(carried), f"the output channel from {peer} closed ({type(e).__name__})")
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


class ChannelClient:
    """A replica's end towards one ingress: `send` queues a request's item, and everything queued
    in one event-loop iteration (one engine step's outputs for all streams) goes out as one frame."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer
        self._pending: list[tuple[str, Any]] = []
        self._flush_scheduled = False
        self.error: BaseException | None = None

    @classmethod
    async def connect(cls, host: str, port: int, key: str) -> "ChannelClient":
        _, writer = await asyncio.open_connection(host, port)
        writer.write(_frame(key.encode()))
        return cls(writer)

    @property
    def broken(self) -> bool:
        return self.error is not None or self._writer.is_closing()

    def send(self, request_id: str, item: Any) -> None:
        if self.broken:
            raise ConnectionError(f"the output channel to the ingress is closed ({self.error!r})")
        self._pending.append((request_id, item))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        if not pending or self.broken:
            return
        try:
            self._writer.write(_frame(pickle.dumps(pending, protocol=pickle.HIGHEST_PROTOCOL)))
        except Exception as e:  # noqa: BLE001 - the requests see it at their next send or drain
            self.error = e

    async def drain(self) -> None:
        """Wait until what was sent is handed to the socket (raises when the channel broke)."""
        await asyncio.sleep(0)  # let a scheduled flush run first
        if self.broken:
            raise ConnectionError(f"the output channel to the ingress is closed ({self.error!r})")
        await self._writer.drain()


class ChannelPool:
    """A replica's channels, one per ingress address, connected on first use and replaced if broken."""

    def __init__(self):
        self._clients: dict[tuple[str, int, str], ChannelClient] = {}
        self._lock = asyncio.Lock()

    async def get(self, address: tuple[str, int, str]) -> ChannelClient:
        client = self._clients.get(address)
        if client is not None and not client.broken:
            return client
        async with self._lock:
            client = self._clients.get(address)
            if client is None or client.broken:
                client = self._clients[address] = await ChannelClient.connect(*address)
            return client
