"""The engine replicas seen from the ingress: the same interface as AsyncLLMEngine, so the HTTP
layer (brisk.server.app) is the single-process server's, unchanged.

Each request becomes one streaming call on the engine deployment's handle, routed by
brisk.cluster.router with the prompt's full-block hashes. The replica's first item says whether it
accepted the request (validation errors are raised here, before any response byte, as in one
process); then a task moves its outputs into the HTTP request's queue. A replica that dies
mid-stream ends the stream with a 503 `replica_lost` error event, never a hang; one that dies
before accepting is retried on another replica (nothing was generated yet).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

from ray.exceptions import RayActorError

from brisk.engine.errors import EngineDeadError
from brisk.engine.kv_cache.hashing import hash_full_blocks
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


def _replica_lost(request_id: str, error: BaseException) -> APIError:
    return APIError(503, f"the replica serving request {request_id} stopped before it finished "
                         f"({type(error).__name__}); send it again: the other replicas take new requests",
                    code="replica_lost", headers={"Retry-After": "1"})


class RemoteEngine:
    def __init__(self, handle, info: dict[str, Any], max_replicas: int):
        from tokenizers import Tokenizer as FastTokenizer

        from brisk.tokenizer import Tokenizer

        self._handle = handle
        self._stream = handle.options(stream=True, method_name="generate")
        self.info = info
        self.max_replicas = max_replicas
        config = dict(info["tokenizer_config"])
        if info["chat_template"] is not None:
            config["chat_template"] = info["chat_template"]
        tokenizer = Tokenizer(FastTokenizer.from_str(info["tokenizer_json"]), config, tuple(info["eos_token_ids"]))
        report = SimpleNamespace(phases_ms=info["load_phases_ms"], total_ms=info["load_total_ms"])
        # what brisk.server.state reads of a loaded model
        self.loaded = SimpleNamespace(tokenizer=tokenizer, dtype=info["dtype"], device=info["device"],
                                      report=report, config=SimpleNamespace(vocab_size=info["vocab_size"]))
        self._tasks: dict[str, tuple[asyncio.Task, Any, tuple[asyncio.Queue, Any]]] = {}
        self._stopped = False

    @classmethod
    def connect(cls, handle, max_replicas: int) -> "RemoteEngine":
        """Blocking (a worker thread): waits for a replica to answer, i.e. for one to have loaded."""
        return cls(handle, handle.info.remote().result(), max_replicas)

    # -- what the server reads -------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return not self._stopped  # one replica's death ends its requests, not the service

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.info["vocab_size"]

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
        for attempt in range(ADD_ATTEMPTS):
            gen = _outside_request(self._stream.remote, prompt, wire, request_id, priority, cache_salt,
                                   prefix_hashes=hashes)
            try:
                first = await gen.__anext__()
                break
            except (asyncio.CancelledError, KeyboardInterrupt):
                gen.cancel()
                raise
            except RayActorError as e:  # the replica died or vanished before accepting: try another
                log.warning("request %s: replica unavailable before accepting (%s); attempt %d of %d",
                            request_id, type(e).__name__, attempt + 1, ADD_ATTEMPTS)
                if attempt + 1 == ADD_ATTEMPTS:
                    raise _replica_lost(request_id, e) from None
        if first[0] == "invalid":
            raise ReplicaParamError(first[1], first[2])
        if first[0] == "dead":
            raise APIError(503, f"a replica's engine stopped ({first[1]}); Ray Serve replaces it, retry",
                           code="engine_dead", headers={"Retry-After": "1"})
        task = asyncio.create_task(self._pump(gen, sink, request_id))
        self._tasks[request_id] = (task, gen, sink)
        task.add_done_callback(lambda _t, rid=request_id: self._tasks.pop(rid, None))
        return RequestStream(self, request_id, sink[0])  # the handle to close (abort); outputs go to the sink

    async def _pump(self, gen, sink: tuple[asyncio.Queue, Any], request_id: str) -> None:
        queue, tag = sink
        try:
            async for item in gen:
                if isinstance(item, tuple):  # ("dead", message): the replica's engine loop stopped
                    queue.put_nowait((tag, APIError(503, f"a replica's engine stopped ({item[1]}); retry",
                                                    code="engine_dead", headers={"Retry-After": "1"})))
                    return
                for out in item:
                    out.produced_at = 0.0  # the replica's clock, maybe another host's: not comparable
                    queue.put_nowait((tag, out))
        except asyncio.CancelledError:
            gen.cancel()  # aborts the request on its replica
            raise
        except RayActorError as e:  # the replica died or became unreachable mid-stream
            log.warning("request %s: its replica was lost mid-stream: %r", request_id, e)
            queue.put_nowait((tag, _replica_lost(request_id, e)))
        except Exception as e:  # noqa: BLE001 - a bug on the replica: an error event, never a hang
            log.error("request %s failed on its replica", request_id, exc_info=e)
            queue.put_nowait((tag, APIError(500, "internal server error on a replica; the server log has the "
                                                 "details")))

    def abort(self, request_id: str) -> None:
        entry = self._tasks.pop(request_id, None)
        if entry is not None:
            entry[0].cancel()

    def fail(self, request_id: str, error: BaseException) -> None:
        entry = self._tasks.pop(request_id, None)
        if entry is not None:
            task, _, (queue, tag) = entry
            task.cancel()
            queue.put_nowait((tag, error))

    def fail_all(self, error: BaseException) -> None:
        for request_id in list(self._tasks):
            self.fail(request_id, error)

    # -- observability ------------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
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


def _outside_request(call, *args, **kwargs):
    """Make a handle call outside the HTTP request's Serve context. Inside it, Ray Serve gives every
    call the request's internal id, and its router matches routing results to pending calls by that
    id: sibling calls of one HTTP request (the `n` choices, the per-replica stats) sent to different
    replicas would wait on each other forever."""
    return contextvars.Context().run(call, *args, **kwargs)
