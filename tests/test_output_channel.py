"""The replicas' output channel to the ingress (brisk.cluster.channel), over real loopback sockets:
every send of one event-loop iteration goes out as one frame, in order; a peer without the key is
dropped before anything is unpickled; a connection that breaks fails exactly the requests it was
carrying that had not finished; an oversized frame is refused."""

import asyncio
import pickle
import struct

import pytest

from brisk.cluster import channel as ch


class Ingress:
    """What RemoteEngine does with the listener's callbacks: items kept per request; "end" closes one."""

    def __init__(self):
        self.items: list[tuple[str, object]] = []
        self.lost: list[tuple[list[str], str]] = []
        self.arrived = asyncio.Event()
        self.listener = ch.OutputListener("127.0.0.1", self.deliver, self.on_lost)

    def deliver(self, request_id, item) -> bool:
        self.items.append((request_id, item))
        self.arrived.set()
        return item != "end"

    def on_lost(self, request_ids, message):
        self.lost.append((request_ids, message))
        self.arrived.set()

    async def wait(self, predicate, timeout=10.0):
        async def until():
            while not predicate():
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(until(), timeout)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_one_frame_per_loop_iteration_in_order(monkeypatch):
    frames = []
    read_frame = ch._read_frame

    async def counting(reader, limit=None):
        frame = await read_frame(reader, limit)
        frames.append(frame)
        return frame

    monkeypatch.setattr(ch, "_read_frame", counting)

    async def main():
        ingress = Ingress()
        client = await ch.ChannelPool().get(await ingress.listener.address())
        for step in range(3):  # three engine steps, each with outputs for three streams
            for request in ("a", "b", "c"):
                client.send(request, f"{request}{step}")
            await client.drain()
        await ingress.wait(lambda: len(ingress.items) == 9)
        ingress.listener.close()
        return list(ingress.items)

    items = run(main())
    assert items == [(r, f"{r}{s}") for s in range(3) for r in ("a", "b", "c")]
    assert len(frames) == 1 + 3  # the key, then one frame per step


def test_a_peer_without_the_key_is_dropped_unread():
    async def main():
        ingress = Ingress()
        host, port, _ = await ingress.listener.address()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(ch._frame(b"0" * 32))
        payload = pickle.dumps([("a", "stolen")])
        writer.write(ch._frame(payload))
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 10)  # EOF: the ingress closed it
        ingress.listener.close()
        return closed, list(ingress.items)

    closed, items = run(main())
    assert closed == b"" and items == []


def test_an_unauthenticated_peer_cannot_make_the_ingress_buffer_a_large_frame():
    async def main():
        ingress = Ingress()
        host, port, _ = await ingress.listener.address()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(struct.pack(">I", ch.MAX_FRAME_BYTES))  # announces 256 MiB instead of a key
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 10)  # closed at once, nothing read
        ingress.listener.close()
        return closed

    assert run(main()) == b""


def test_a_broken_connection_fails_only_its_unfinished_requests():
    async def main():
        ingress = Ingress()
        address = await ingress.listener.address()
        pool = ch.ChannelPool()
        client = await pool.get(address)
        client.send("done", "x")
        client.send("done", "end")
        client.send("open", "x")
        await client.drain()
        await ingress.wait(lambda: len(ingress.items) == 3)
        client._writer.transport.abort()  # the replica's process died
        await ingress.wait(lambda: ingress.lost)
        with pytest.raises(ConnectionError):
            client.send("open", "y")
        replaced = await pool.get(address)  # the next request reconnects
        replaced.send("new", "z")
        await replaced.drain()
        await ingress.wait(lambda: ("new", "z") in ingress.items)
        ingress.listener.close()
        return list(ingress.lost), replaced is not client

    lost, reconnected = run(main())
    assert [ids for ids, _ in lost] == [["open"]] and "closed" in lost[0][1]
    assert reconnected


def test_an_oversized_frame_closes_the_connection(monkeypatch):
    monkeypatch.setattr(ch, "MAX_FRAME_BYTES", 1000)

    async def main():
        ingress = Ingress()
        host, port, key = await ingress.listener.address()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(ch._frame(key.encode()))
        writer.write(ch._frame(pickle.dumps([("open", "x")])))
        writer.write(struct.pack(">I", 10**9))
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 10)
        await ingress.wait(lambda: ingress.lost)
        ingress.listener.close()
        return closed, list(ingress.lost)

    closed, lost = run(main())
    assert closed == b"" and lost[0][0] == ["open"] and "ValueError" in lost[0][1]
