"""What the HTTP server needs of an engine, declared once: `AsyncLLMEngine` (one process) and
`brisk.cluster.remote.RemoteEngine` (Ray Serve replicas) both implement `EngineClient`, so the
server reads the same members of either and nothing has to imitate a loaded model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from brisk.engine.outputs import RequestOutput
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.stats import EngineStats


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the server reports it (build info, load metrics)."""

    dtype: str  # "float32", "bfloat16", ...
    device: str  # "cpu", "cuda:0"
    load_phases_ms: dict[str, float] = field(default_factory=dict)
    load_total_ms: float = 0.0
    architecture: str = ""  # the model's HF architecture (GptOssForCausalLM: replies in harmony)


@runtime_checkable
class EngineClient(Protocol):
    @property
    def is_alive(self) -> bool: ...

    @property
    def tokenizer(self) -> Any: ...  # brisk.tokenizer.Tokenizer

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def pooling(self) -> Any: ...  # brisk.loading.pooling.Pooling of an embedding model, or None (generative)

    async def add(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                  priority: int = 0, cache_salt: str | None = None,
                  sink: tuple[asyncio.Queue, Any] | None = None) -> Any:
        """Start a request; its outputs (RequestOutput, or the exception that ended it) go to `sink`
        as (tag, item). Returns a handle with close() and mark_done()."""

    def abort(self, request_id: str) -> None: ...

    def fail(self, request_id: str, error: BaseException) -> None: ...

    def fail_all(self, error: BaseException) -> None: ...

    async def stats(self) -> EngineStats:
        """All of the engine's requests and KV cache (several replicas: combined)."""

    async def stats_by_replica(self) -> dict[str, EngineStats] | None:
        """Each answering replica's stats; None for one engine in this process."""

    def shutdown(self) -> None: ...


__all__ = ["EngineClient", "ModelInfo", "RequestOutput"]
