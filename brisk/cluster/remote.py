"""The engine replicas seen from the ingress: the same interface as AsyncLLMEngine, so the HTTP
layer (brisk.server.app) is the single-process server's, unchanged.

Each request becomes one streaming call on the engine deployment's handle, routed by
brisk.cluster.router with the prompt's full-block hashes. The replica's first item says whether it
accepted the request (validation errors are raised here, before any response byte, as in one
process). Its outputs then arrive over this ingress's output channel (brisk.cluster.channel; one
TCP frame per engine step for all streams), or as further items of the Ray stream with
`--replica-stream ray`; either way they go straight into the HTTP request's queue. A replica that
dies mid-stream (its Ray call raises, or its channel connection drops) ends the stream with a 503
`replica_lost` error event, never a hang; one that dies before accepting is retried on another
replica (nothing was generated yet).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from typing import Any

from ray.exceptions import RayActorError

from brisk.cluster.messages import Accepted, ChannelLost, EngineDead, Failure, Invalid
from brisk.engine.client import ModelInfo
from brisk.engine.errors import EngineDeadError
from brisk.engine.kv_cache.hashing import hash_full_blocks
from brisk.engine.stats import EngineStats
from brisk.engine.stream import RequestStream
from brisk.server.errors import APIError

log = logging.getLogger("brisk.cluster")

ADD_ATTEMPTS = 3  # replicas tried for one request when they die before accepting it
STATS_TIMEOUT_S = 5.0


class ReplicaParamError(ValueError):
    """A request field the replica's engine refused (the HTTP layer answers 400 naming `field`)."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


def _replica_lost(request_id: str, why: str) -> APIError:
    return APIError(503, f"the replica serving request {request_id} stopped before it finished "
                         f"({why}); send it again: the other replicas take new requests",
                    code="replica_lost", headers={"Retry-After": "1"})


def _engine_dead(message: str) -> APIError:
    return APIError(503, f"a replica's engine stopped ({message}); Ray Serve replaces it, retry",
                    code="engine_dead", headers={"Retry-After": "1"})


class RemoteEngine:
    def __init__(self, handle, info: dict[str, Any], max_replicas: int, channel_host: str | None = None):
        """`channel_host`: where this ingress listens for the replicas' outputs (None: they come
        as Ray stream items)."""
        from tokenizers import Tokenizer as FastTokenizer

        from brisk.tokenizer import Tokenizer

        self._handle = handle
        self._stream = handle.options(stream=True, method_name="generate")
        self.info = info
        self.max_replicas = max_replicas
        config = dict(info["tokenizer_config"])
        if info["chat_template"] is not None:
            config["chat_template"] = info["chat_template"]
        self._tokenizer = Tokenizer(FastTokenizer.from_str(info["tokenizer_json"]), config,
                                    tuple(info["eos_token_ids"]))
        self.model_info = ModelInfo(info["dtype"], info["device"], dict(info["load_phases_ms"]),
                                    info["load_total_ms"], info.get("architecture", ""))
        self._tasks: dict[str, tuple[asyncio.Task, Any]] = {}
        self._open: dict[str, tuple[asyncio.Queue, Any]] = {}  # request id -> its HTTP sink, until it ends
        self._stopped = False
        self._listener = None
        if channel_host is not None:
            from brisk.cluster.channel import OutputListener

            self._listener = OutputListener(channel_host, self._deliver, self._channel_lost)

    @classmethod
    def connect(cls, handle, max_replicas: int, channel_host: str | None = None) -> "RemoteEngine":
        """Blocking (a worker thread): waits for a replica to answer, i.e. for one to have loaded."""
        return cls(handle, handle.info.remote().result(), max_replicas, channel_host)

    # -- what the server reads -------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return not self._stopped  # one replica's death ends its requests, not the service

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.info["vocab_size"]

    @property
    def pooling(self):
        from brisk.loading.pooling import Pooling

        found = self.info.get("pooling")
        return Pooling(**found) if found else None

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    @property
    def max_num_seqs(self) -> int:
        """Sequences running at once across the largest replica set (the admission bound)."""
        return self.info["max_num_seqs"] * self.max_replicas

    # -- requests --------------------------------------------------------------------------
    async def add(self, prompt: list[int], params=None, request_id: str | None = None, priority: int = 0,
                  cache_salt: str | None = None, sink: tuple[asyncio.Queue, Any] | None = None):
        if self._stopped:
            raise EngineDeadError("the ingress is shut down")
        if sink is None or request_id is None:
            raise TypeError("RemoteEngine.add needs a request_id and a sink (the server's way of calling it)")
        hashes = hash_full_blocks(prompt, self.info["block_size"], cache_salt)
        wire = params
        if params is not None and getattr(params, "grammar", None) is not None:
            wire = dataclasses.replace(params, grammar=params.grammar.spec)  # compiled on the replica
        channel = await self._listener.address() if self._listener is not None else None
        self._open[request_id] = sink  # before the call: the channel may bring outputs before the accept
        try:
            first, gen = await self._call(prompt, wire, request_id, priority, cache_salt, hashes, channel)
        except BaseException:
            self._open.pop(request_id, None)
            raise
        if not isinstance(first, Accepted):
            self._open.pop(request_id, None)
            if isinstance(first, Invalid):
                raise ReplicaParamError(first.message, first.field)
            raise self._failure(request_id, first)
        task = asyncio.create_task(self._pump(gen, request_id))
        self._tasks[request_id] = (task, gen)
        task.add_done_callback(lambda _t, rid=request_id: self._tasks.pop(rid, None))
        return RequestStream(self, request_id, sink[0])  # the handle to close (abort); outputs go to the sink

    async def _call(self, prompt, wire, request_id, priority, cache_salt, hashes, channel):
        """The replica's first item and its stream, trying another replica if one dies before accepting."""
        for attempt in range(ADD_ATTEMPTS):
            gen = _outside_request(self._stream.remote, prompt, wire, request_id, priority, cache_salt,
                                   prefix_hashes=hashes, channel=channel)
            try:
                return await gen.__anext__(), gen
            except (asyncio.CancelledError, KeyboardInterrupt):
                gen.cancel()
                raise
            except RayActorError as e:  # the replica died or vanished before accepting: try another
                log.warning("request %s: replica unavailable before accepting (%s); attempt %d of %d",
                            request_id, type(e).__name__, attempt + 1, ADD_ATTEMPTS)
                if attempt + 1 == ADD_ATTEMPTS:
                    raise _replica_lost(request_id, type(e).__name__) from None
        raise AssertionError("unreachable")

    def _deliver(self, request_id: str, item) -> bool:
        """One item for a request (from the channel or the Ray stream) into its HTTP queue; whether the
        request is still open after it. Items of a request that ended (aborted, failed) are dropped."""
        sink = self._open.get(request_id)
        if sink is None:
            return False
        queue, tag = sink
        if isinstance(item, (EngineDead, ChannelLost)):
            self._end(request_id, self._failure(request_id, item))
            return False
        for out in item:
            out.produced_at = 0.0  # the replica's clock, maybe another host's: not comparable
            queue.put_nowait((tag, out))
        if item and item[-1].finished:
            self._open.pop(request_id, None)
            return False
        return True

    @staticmethod
    def _failure(request_id: str, message: Failure) -> Exception:
        """The error a request ends with when its replica says it failed."""
        if isinstance(message, ChannelLost):
            return _replica_lost(request_id, message.message)
        if isinstance(message, EngineDead):
            return _engine_dead(message.message)
        raise TypeError(f"request {request_id}: unexpected message from the replica: {message!r}")

    def _end(self, request_id: str, error: BaseException) -> None:
        sink = self._open.pop(request_id, None)
        if sink is not None:
            queue, tag = sink
            queue.put_nowait((tag, error))

    def _channel_lost(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            log.warning("request %s: %s", request_id, message)
            self._end(request_id, _replica_lost(request_id, message))

    async def _pump(self, gen, request_id: str) -> None:
        """Follows the request's Ray stream: its outputs with --replica-stream ray, its replica's death
        either way. With the channel, the stream ends once the last output is on the socket."""
        try:
            async for item in gen:
                self._deliver(request_id, item)
        except asyncio.CancelledError:
            gen.cancel()  # aborts the request on its replica
            self._open.pop(request_id, None)
            raise
        except RayActorError as e:  # the replica died or became unreachable mid-stream
            if request_id in self._open:
                log.warning("request %s: its replica was lost mid-stream: %r", request_id, e)
            self._end(request_id, _replica_lost(request_id, type(e).__name__))
        except Exception as e:  # noqa: BLE001 - a bug on the replica: an error event, never a hang
            log.error("request %s failed on its replica", request_id, exc_info=e)
            self._end(request_id, APIError(500, "internal server error on a replica; the server log has the "
                                                "details"))

    def abort(self, request_id: str) -> None:
        self._open.pop(request_id, None)
        entry = self._tasks.pop(request_id, None)
        if entry is not None:
            entry[0].cancel()

    def fail(self, request_id: str, error: BaseException) -> None:
        entry = self._tasks.pop(request_id, None)
        if entry is not None:
            entry[0].cancel()
        self._end(request_id, error)

    def fail_all(self, error: BaseException) -> None:
        for request_id in set(self._tasks) | set(self._open):  # a stream may have ended with outputs in flight
            self.fail(request_id, error)

    # -- observability ------------------------------------------------------------------------
    async def stats(self) -> EngineStats:
        """Every answering replica's stats, combined."""
        return EngineStats.combine(list((await self.stats_by_replica()).values()))

    async def stats_by_replica(self) -> dict[str, EngineStats]:
        """{replica id: EngineStats} of every running replica that answers within STATS_TIMEOUT_S."""
        from brisk.cluster.registry import replica_ids

        return await asyncio.to_thread(self._stats_blocking, replica_ids())

    def _stats_blocking(self, ids: list[str]) -> dict[str, Any]:
        stats = self._handle.options(method_name="stats")
        calls = [_outside_request(stats.remote, brisk_replica=rid) for rid in ids]
        out = {}
        for call in calls:
            try:
                rid, stats = call.result(timeout_s=STATS_TIMEOUT_S)
                out[rid] = stats
            except Exception as e:  # noqa: BLE001 - a replica that died or hangs is left out of this scrape
                log.warning("a replica's stats were left out of /metrics: %r", e)
        return out

    def shutdown(self) -> None:
        self._stopped = True
        if self._listener is not None:
            self._listener.close()


def _outside_request(call, *args, **kwargs):
    """Make a handle call outside the HTTP request's Serve context. Inside it, Ray Serve gives every
    call the request's internal id, and its router matches routing results to pending calls by that
    id: sibling calls of one HTTP request (the `n` choices, the per-replica stats) sent to different
    replicas would wait on each other forever."""
    return contextvars.Context().run(call, *args, **kwargs)
