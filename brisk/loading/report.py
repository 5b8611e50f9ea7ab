"""Load-time report: how long each phase of getting a model ready took."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class LoadReport:
    """Phases in the order they ran, in milliseconds, plus facts about the load."""

    phases_ms: dict[str, float] = field(default_factory=dict)
    source: str = ""
    path: str = ""
    format: str = ""  # "safetensors" | "gguf"
    conversion_cache: str = ""  # "hit" | "miss" | "" (not a GGUF)
    weight_bytes: int = 0
    device: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""  # the KV cache's element type (brisk/kv_dtype.py), once the engine has one
    weight_formats: dict[str, str] = field(default_factory=dict)  # layer type -> quantized format
    parameters_total: int = 0  # weight parameters (ModelConfig.parameter_counts)
    parameters_active: int = 0  # of which one token reads (a mixture of experts: its k routed experts)
    experts: str = ""  # "8 of 128 experts a token in 48 layers" for a mixture of experts
    pooling: str = ""  # an embedding model's pooling ("last pooling, L2-normalised (from modules.json)")
    # what the load changed about the weights that the user should know: a format widened, never silently
    notes: list[str] = field(default_factory=list)
    current_phase: str | None = None  # the phase running now (read by the server's /ready)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        self.current_phase = name
        try:
            yield
        finally:
            self.current_phase = None
            self.phases_ms[name] = self.phases_ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3

    def add(self, name: str, ms: float) -> None:
        self.phases_ms[name] = self.phases_ms.get(name, 0.0) + ms

    @property
    def total_ms(self) -> float:
        return sum(self.phases_ms.values())

    def to_dict(self) -> dict:
        return {
            "source": self.source, "path": self.path, "format": self.format,
            "conversion_cache": self.conversion_cache, "weight_bytes": self.weight_bytes,
            "device": self.device, "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype,
            "weight_formats": self.weight_formats, "parameters_total": self.parameters_total,
            "parameters_active": self.parameters_active, "experts": self.experts, "pooling": self.pooling,
            "notes": self.notes,
            "phases_ms": {k: round(v, 2) for k, v in self.phases_ms.items()},
            "total_ms": round(self.total_ms, 2),
        }

    def summary(self) -> str:
        """Parameters, total and (a mixture of experts) active per token."""
        if self.parameters_active == self.parameters_total:
            return f"parameters: {_count(self.parameters_total)}"
        return (f"parameters: {_count(self.parameters_total)} total, {_count(self.parameters_active)} active per token "
                f"({self.experts})")

    def lines(self) -> list[str]:
        out = [f"loaded {self.source} ({self.format}, {self.weight_bytes / 1e6:.0f} MB, "
               f"{self.dtype} on {self.device}" + (f", KV cache {self.kv_cache_dtype}" if self.kv_cache_dtype else "")
               + (f", conversion cache {self.conversion_cache}" if self.conversion_cache else "") + ")"]
        if self.parameters_total:
            out.append("  " + self.summary())
        if self.pooling:
            out.append(f"  embedding model: {self.pooling}")
        if self.weight_formats:
            out.append("  weight formats: " + ", ".join(f"{k} {v}" for k, v in self.weight_formats.items()))
        out += [f"  note: {note}" for note in self.notes]
        out += [f"  {name:<20} {ms:9.1f} ms" for name, ms in self.phases_ms.items()]
        out.append(f"  {'total':<20} {self.total_ms:9.1f} ms")
        return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
