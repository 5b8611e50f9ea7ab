"""One engine replica of a Ray Serve deployment: the model and its engine, loaded in the constructor.

Ray Serve marks a replica RUNNING, and routes to it, only once its constructor returned: a replica
takes no traffic while it loads (the cold-start killer), and one that fails to load is retried by
Serve. `check_health` fails once the engine loop died, so Serve replaces the replica.

The ingress (brisk.cluster.remote) speaks to it with plain picklable values:
- `info()`: what the HTTP layer needs of the model (tokenizer, limits, load report);
- `generate(...)`: a stream whose first item is `Accepted`, or `Invalid` / `EngineDead` /
  `ChannelLost` (brisk/cluster/messages.py). Then the outputs: lists of RequestOutputs (every
  output ready at once; with --stream-interval N, held until N new tokens, except the first token
  and the last output), ending with the finished one, or `EngineDead` if the engine loop died
  meanwhile. With a `channel` (the ingress's (host, port, key), brisk.cluster.channel) they go over
  that TCP connection, one frame per engine step for all of that ingress's streams, and the Ray
  stream ends once the last one is on the socket, or yields `ChannelLost` if the channel broke;
  without, each list is one more item of the Ray stream (--replica-stream ray);
- `stats()`: (replica id, EngineStats) for the ingress's /metrics.
Closing the stream (client gone, timeout) cancels the generator here, which aborts the request.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from typing import Any

from brisk.cluster.channel import ChannelPool
from brisk.cluster.messages import Accepted, ChannelLost, EngineDead, Invalid
from brisk.engine.errors import EngineDeadError
from brisk.loading.report import LoadReport

log = logging.getLogger("brisk.cluster")


class EngineReplica:
    def __init__(self, serve_args: dict[str, Any], max_model_len: int, chat_template: str | None):
        from brisk.engine.factory import load_async_engine

        args = argparse.Namespace(**serve_args)
        self.report = LoadReport()
        self.engine = load_async_engine(args, max_model_len, chat_template, self.report)
        self.block_size = args.block_size
        self.stream_interval = getattr(args, "stream_interval", None) or 1
        self._grammars = None
        self._channels = ChannelPool()
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests constructing it directly)
            self.replica_id = f"pid{os.getpid()}"
        import torch

        self.torch_threads = torch.get_num_threads()
        log.info("replica %s ready: %d torch threads, OMP_NUM_THREADS=%s", self.replica_id, self.torch_threads,
                 os.environ.get("OMP_NUM_THREADS"))

    def info(self) -> dict[str, Any]:
        engine = self.engine
        tok = engine.tokenizer
        model = engine.model_info
        return {
            "replica": self.replica_id,
            "vocab_size": engine.vocab_size,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.max_num_seqs,
            "block_size": self.block_size,
            "torch_threads": self.torch_threads,
            "dtype": model.dtype,
            "device": model.device,
            "tokenizer_json": tok.fast.to_str(),
            "tokenizer_config": {k: v for k, v in tok.config.items() if k != "chat_template"},
            "chat_template": tok.chat_template_source,
            "eos_token_ids": list(tok.eos_token_ids),
            "load_phases_ms": model.load_phases_ms,
            "load_total_ms": model.load_total_ms,
            "architecture": model.architecture,
            "pooling": dataclasses.asdict(engine.pooling) if engine.pooling is not None else None,
        }

    async def generate(self, prompt_ids: list[int], params, request_id: str, priority: int = 0,
                       cache_salt: str | None = None, prefix_hashes: list[bytes] | None = None,
                       channel: tuple[str, int, str] | None = None):
        """`prefix_hashes` is the router's (brisk.cluster.router); the engine hashes blocks itself."""
        try:
            params = await self._compile_grammar(params)
        except ValueError as e:
            yield Invalid(str(e), getattr(e, "field", None))
            return
        client = None
        if channel is not None:
            try:
                client = await self._channels.get(tuple(channel))
            except OSError as e:
                yield ChannelLost(f"replica {self.replica_id} cannot reach the ingress's output channel at "
                                  f"{channel[0]}:{channel[1]} ({e}); check that the nodes can connect to each other "
                                  "on any port, or serve with --replica-stream ray")
                return
        ready: asyncio.Queue = asyncio.Queue()  # --replica-stream ray: the groups to yield
        emit = ready.put_nowait if client is None else (lambda item: client.send(request_id, item))
        batcher = _OutputBatcher(self.stream_interval, emit)
        try:
            stream = await self.engine.add(prompt_ids, params, request_id=request_id, priority=priority,
                                           cache_salt=cache_salt, sink=(batcher, None))
        except EngineDeadError as e:
            yield EngineDead(str(e))
            return
        except ValueError as e:
            yield Invalid(str(e), getattr(e, "field", None))
            return
        yield Accepted()
        try:
            if client is not None:
                await batcher.done  # the outputs go out from the engine's callbacks, a frame per step
                stream.mark_done()
                await client.drain()
                return
            while True:
                groups = [await ready.get()]
                while not ready.empty():  # groups that piled up go as one Ray message
                    groups.append(ready.get_nowait())
                outputs = [out for group in groups if isinstance(group, list) for out in group]
                failure = next((group for group in groups if isinstance(group, EngineDead)), None)
                if outputs:
                    yield outputs
                if failure is not None or (outputs and outputs[-1].finished):
                    stream.mark_done()
                    if failure is not None:
                        yield failure
                    return
        except ConnectionError as e:  # the channel to the ingress broke: this request ends here
            yield ChannelLost(f"replica {self.replica_id} lost its output channel to the ingress: {e}")
        finally:  # finished: nothing to abort; cancelled (the ingress closed the stream): abort
            stream.close()
            batcher.done.cancel()  # outputs still in flight are dropped, not sent after the end

    async def _compile_grammar(self, params):
        """The ingress sends a grammar as its spec (a compiled matcher does not cross processes);
        compiled here once per distinct spec (cached), in a worker thread."""
        from brisk.structured.spec import GrammarSpec

        if not isinstance(getattr(params, "grammar", None), GrammarSpec):
            return params
        if self._grammars is None:
            from brisk.structured.compiler import GrammarCompiler

            tok = self.engine.tokenizer
            self._grammars = GrammarCompiler(tok.fast, self.engine.vocab_size, tok.eos_token_ids)
        compiled = await asyncio.to_thread(self._grammars.compile, params.grammar)
        return dataclasses.replace(params, grammar=compiled)

    async def stats(self, brisk_replica: str | None = None):
        """`brisk_replica` pins the call to this replica (brisk.cluster.router)."""
        return self.replica_id, await self.engine.stats()

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop stopped")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class _OutputBatcher:
    """One request's sink in the engine (AsyncLLMEngine calls `put_nowait((tag, item))` on this
    replica's event loop, once per step): groups its outputs per --stream-interval (the first token
    and the last output at once) and hands each group to `emit`, or `EngineDead` when the
    engine loop stopped; `done` resolves then, or fails with the channel's ConnectionError.

    The server asks for "delta" outputs, which carry their cumulative `text` on the last one only
    (pickled, it would make every step cost O(output so far)); `text_offset` says where each
    delta starts."""

    def __init__(self, interval: int, emit):
        self.interval, self.emit = interval, emit
        self.pending: list = []
        self.held_tokens, self.sent_first = 0, False
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def put_nowait(self, tagged) -> None:
        item = tagged[1]
        if self.done.done():
            return
        try:
            if isinstance(item, BaseException):
                self._flush()
                self.emit(EngineDead(str(item)))
                self.done.set_result(None)
                return
            self.pending.append(item)
            self.held_tokens += len(item.delta_token_ids)
            if item.finished or not self.sent_first or self.held_tokens >= self.interval:
                self._flush()
            if item.finished:
                self.done.set_result(None)
        except ConnectionError as e:
            self.done.set_exception(e)

    def _flush(self) -> None:
        if not self.pending:
            return
        group, self.pending, self.held_tokens, self.sent_first = self.pending, [], 0, True
        self.emit(group)
