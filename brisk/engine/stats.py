"""Engine statistics as plain dataclasses (the server exports them)."""

from __future__ import annotations

from dataclasses import asdict, fields, dataclass


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
    # speculative decoding: drafted and accepted tokens, and how many verifications accepted
    # exactly i tokens (index i = 0..k); empty when speculation is off
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_lengths: tuple[int, ...] = ()
    # the KV pool's bytes, and how many of them are in memory (the pool is touched lazily, so
    # resident memory grows until every block has been written once); 0 where unknown
    kv_cache_bytes: int = 0
    kv_cache_resident_bytes: int = 0
    kv_cache_dtype: str = ""  # brisk/kv_dtype.py's name of the pool's element type
    # the disk tier (--kv-cache-dir): prompt tokens found there, blocks read, refused (corrupt), written and
    # not written (the write queue was full, or the disk failed); all 0 without one
    kv_disk_hits_tokens: int = 0
    kv_disk_blocks_read: int = 0
    kv_disk_blocks_corrupt: int = 0
    kv_disk_blocks_written: int = 0
    kv_disk_blocks_not_written: int = 0
    kv_disk_budget_bytes: int = 0  # --kv-cache-disk-bytes where --kv-cache-dir is set; 0: no disk tier
    kv_disk_bytes: int = 0  # what the tier's folder holds now (as this process last measured it)
    kv_disk_loads: int = 0  # prefixes read from the disk tier (off the engine's thread)
    kv_disk_load_seconds: float = 0.0  # the time those reads took, in all
    # the host tier (--kv-cache-host-bytes): prompt tokens found there, blocks taken back into the pool, blocks
    # the pool spilled there and blocks dropped for the budget; all 0 without one
    kv_host_hits_tokens: int = 0
    kv_host_misses_tokens: int = 0  # prompt tokens (full blocks) past the pool's that the host tier did not have
    kv_disk_misses_tokens: int = 0  # ... past the pool's and the host tier's that the disk tier did not have
    kv_host_blocks_read: int = 0
    kv_host_blocks_stored: int = 0
    kv_host_blocks_evicted: int = 0
    kv_host_budget_bytes: int = 0  # --kv-cache-host-bytes; 0: no host tier
    kv_host_bytes: int = 0  # what the tier holds now

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def combine(cls, parts: list["EngineStats"]) -> "EngineStats":
        """Several engines (Ray Serve replicas) as one: counts add up, KV usage and fragmentation
        are the whole pool's."""
        if not parts:
            return cls(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0, 0)
        total = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(cls)
                 if f.name not in ("kv_usage", "kv_internal_fragmentation", "spec_acceptance_lengths",
                                   "kv_cache_dtype")}
        total["kv_cache_dtype"] = "/".join(sorted({p.kv_cache_dtype for p in parts}))  # one per pool, as a rule
        used = total["kv_blocks_used"]
        lengths = [sum(c) for c in zip(*(p.spec_acceptance_lengths for p in parts if p.spec_acceptance_lengths))]
        return cls(**total, kv_usage=used / total["kv_blocks_total"] if total["kv_blocks_total"] else 0.0,
                   kv_internal_fragmentation=sum(p.kv_internal_fragmentation * p.kv_blocks_used for p in parts)
                   / used if used else 0.0, spec_acceptance_lengths=tuple(lengths))


class SpecStats:
    """Speculative decoding counters of one engine (mutated on the engine thread only)."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafted = 0
        self.num_accepted = 0
        self.acceptance_lengths = [0] * (num_speculative_tokens + 1 if num_speculative_tokens else 0)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.acceptance_lengths[num_accepted] += 1
