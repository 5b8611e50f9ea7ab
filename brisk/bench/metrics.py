"""Benchmark metric math, with the definitions of vLLM's benchmark (DESIGN.md):

- TTFT: request sent -> first content-bearing chunk received.
- ITL: gaps between consecutive content-bearing chunks, pooled over requests.
- TPOT: (E2E - TTFT) / (output_tokens - 1), per request with more than one output token.
- E2E: request sent -> last chunk.
- Throughput: output tokens / wall time of the run; goodput: requests meeting every SLO / time.
- All-decoding throughput: content chunks per second in the window where every request of the run
  has its first chunk and none has ended (a decode-only figure: no prompt is being processed).

Pure Python + numpy; timestamps are `time.perf_counter()` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    sent_ts: float
    chunk_ts: list[float] = field(default_factory=list)  # arrival of each content-bearing chunk
    end_ts: float | None = None
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    server_timings: dict[str, Any] | None = None  # brisk's usage.brisk when offered
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    due_ts: float | None = None  # when the schedule wanted it sent (queue time = sent_ts - due_ts)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_ts is not None

    def tier_cached_tokens(self, tier: str) -> int | None:
        """Of the cached prompt tokens, those brisk found in one KV tier ("host": --kv-cache-host-bytes, "disk":
        --kv-cache-dir; usage.brisk's by-tier split); None where the reply did not say."""
        tiers = (self.server_timings or {}).get("cached_prompt_tokens_by_tier")
        if not isinstance(tiers, dict):
            return None
        value = tiers.get(tier, 0 if "disk" in tiers else None)  # a reply from before the host tier: none there
        return value if isinstance(value, int) else None

    @property
    def disk_cached_tokens(self) -> int | None:
        return self.tier_cached_tokens("disk")

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_ts[0] - self.sent_ts if self.chunk_ts else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_ts is None else self.end_ts - self.sent_ts

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_ts, self.chunk_ts[1:])]

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or not self.output_tokens or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    mean: float
    median: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> "Distribution | None":
        if not values:
            return None
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(arr, PERCENTILES)
        return cls(float(arr.mean()), float(p50), float(p90), float(p99), len(values))

    def ms(self) -> dict[str, float]:
        return {"mean_ms": self.mean * 1e3, "median_ms": self.median * 1e3, "p90_ms": self.p90 * 1e3,
                "p99_ms": self.p99 * 1e3}


@dataclass(frozen=True)
class SLO:
    """Per-request latency limits in milliseconds (None = no limit)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        checks = [(self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2el_ms, r.e2e_s)]
        return r.ok and all(limit is None or (value is not None and value * 1e3 <= limit) for limit, value in checks)


@dataclass
class Summary:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None
    goodput: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    cached_input_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    disk_cached_input_tokens: int | None = None  # of those, read from brisk's KV disk tier (when every reply said)
    host_cached_input_tokens: int | None = None  # of those, taken from brisk's KV host tier (likewise)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if self.cached_input_tokens is None or not self.total_input_tokens:
            return None
        return self.cached_input_tokens / self.total_input_tokens

    @property
    def disk_hit_rate(self) -> float | None:
        if self.disk_cached_input_tokens is None or not self.total_input_tokens:
            return None
        return self.disk_cached_input_tokens / self.total_input_tokens

    @property
    def host_hit_rate(self) -> float | None:
        if self.host_cached_input_tokens is None or not self.total_input_tokens:
            return None
        return self.host_cached_input_tokens / self.total_input_tokens

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "duration": self.duration_s, "completed": self.completed, "failed": self.failed,
            "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput, "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput, "request_goodput": self.goodput,
            "errors": self.errors, "cached_input_tokens": self.cached_input_tokens,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "disk_cached_input_tokens": self.disk_cached_input_tokens, "disk_hit_rate": self.disk_hit_rate,
            "host_cached_input_tokens": self.host_cached_input_tokens, "host_hit_rate": self.host_hit_rate,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            dist: Distribution | None = getattr(self, name)
            for key, value in (dist.ms() if dist else {}).items():
                out[f"{key.split('_')[0]}_{name}_ms"] = value
        return out


def summarize(records: list[RequestRecord], slo: SLO | None = None) -> Summary:
    if not records:
        raise ValueError("no requests to summarize")
    start = min(r.sent_ts for r in records)
    end = max((r.end_ts or r.sent_ts) for r in records)
    duration = max(end - start, 1e-9)
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unfinished"] = errors.get(r.error or "unfinished", 0) + 1
    inputs = sum(r.prompt_tokens or 0 for r in ok)
    outputs = sum(r.output_tokens or 0 for r in ok)
    reported = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    cached = sum(reported) if ok and len(reported) == len(ok) else None  # only when every reply said
    disk, host = (_tier_total(ok, tier) for tier in ("disk", "host"))
    return Summary(
        duration_s=duration, completed=len(ok), failed=len(records) - len(ok), total_input_tokens=inputs,
        total_output_tokens=outputs, request_throughput=len(ok) / duration, output_throughput=outputs / duration,
        total_token_throughput=(inputs + outputs) / duration,
        ttft=Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Distribution.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.itl_s]),
        e2el=Distribution.of([r.e2e_s for r in ok]),
        goodput=None if slo is None else sum(slo.met_by(r) for r in ok) / duration,
        errors=errors, cached_input_tokens=cached, disk_cached_input_tokens=disk, host_cached_input_tokens=host,
    )


def _tier_total(ok: list[RequestRecord], tier: str) -> int | None:
    """The prompt tokens the replies found in one of brisk's KV tiers, when every reply said."""
    found = [r.tier_cached_tokens(tier) for r in ok]
    return sum(found) if ok and None not in found else None


@dataclass(frozen=True)
class DecodeWindow:
    tokens_per_s: float  # content chunks per second (one per token when chunks carry one token each)
    seconds: float
    chunks: int


def all_decoding_window(records: list[RequestRecord]) -> DecodeWindow | None:
    """Throughput while every request decodes: from the last first chunk to the first end. None when
    the requests never all ran at once (more requests than streams, or a failed request)."""
    if not records or not all(r.ok and r.chunk_ts for r in records):
        return None
    start = max(r.chunk_ts[0] for r in records)
    end = min(r.end_ts for r in records)  # type: ignore[type-var]  (ok: end_ts is set)
    if end <= start:
        return None
    chunks = sum(1 for r in records for ts in r.chunk_ts if start < ts <= end)
    return DecodeWindow(chunks / (end - start), end - start, chunks)
