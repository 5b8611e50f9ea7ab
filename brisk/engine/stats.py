"""Engine statistics as plain dataclasses (the server exports them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    kv_blocks_free: int
    kv_usage: float  # used / total
    kv_internal_fragmentation: float  # unfilled slots in used blocks / slots of used blocks
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_preemptions: int
    num_steps: int
    prompt_tokens: int  # prompt tokens computed (prefilled), cache hits excluded
    generation_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)
