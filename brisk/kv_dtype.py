"""The KV cache's element type: the names users give (vLLM's `--kv-cache-dtype`), what each costs
in bytes, the code the compiled kernels take (brisk/kernels/kv_types.h), and what `auto` means on
this machine. Torch-free: `serve` checks the flag, and `kv-plan` sizes a pool, before torch loads.

int8 is blockwise like llama.cpp's q8_0, with one float32 scale per token and KV head (a block of
head_dim elements: 64 or 128 on the models people run); the scales live beside the cache."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from brisk.errors import BriskError


@dataclass(frozen=True)
class KVDtype:
    name: str  # canonical: float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8
    code: int  # kv_types.h's Code
    element_bytes: int
    scaled: bool = False  # a float32 scale per (token, KV head) beside the elements
    max_value: float | None = None  # writes saturate here (narrow floats)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one token's K (or V) takes for one KV head, its scale included."""
        return head_dim * self.element_bytes + (4 if self.scaled else 0)

    def bytes_per_element(self, head_dim: int) -> float:
        return self.row_bytes(head_dim) / head_dim

    @property
    def quantized(self) -> bool:
        """Lossy beyond a 16-bit float: 8 bits per element."""
        return self.element_bytes == 1


FLOAT32 = KVDtype("float32", 0, 4)
BFLOAT16 = KVDtype("bfloat16", 1, 2)
FLOAT16 = KVDtype("float16", 2, 2, max_value=65504.0)
FP8_E4M3 = KVDtype("fp8_e4m3", 3, 1, max_value=448.0)
FP8_E5M2 = KVDtype("fp8_e5m2", 4, 1, max_value=57344.0)
INT8 = KVDtype("int8", 5, 1, scaled=True)

DTYPES = {d.name: d for d in (FLOAT32, BFLOAT16, FLOAT16, FP8_E4M3, FP8_E5M2, INT8)}
# what users type (vLLM's spellings, llama.cpp's, the short ones) -> canonical name
ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16",
           "half": "float16", "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "q8_0": "int8"}
CHOICES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


def parse_name(value: str) -> str:
    """argparse type for --kv-cache-dtype / --kv-dtype: a known name or alias, kept as given."""
    if value in CHOICES or value in ALIASES:
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not a KV cache dtype; use one of {', '.join(CHOICES)}")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo); empty where the OS does not say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _cpu_missing(dtype: KVDtype, flags: frozenset[str]) -> str | None:
    """The instruction set a CPU lacks to read this dtype at useful speed, or None."""
    if not flags or dtype.name == "float32":
        return None  # unknown CPU: the kernel picks its path at run time
    if "avx2" not in flags or "fma" not in flags:
        return "AVX2 and FMA"
    if dtype.element_bytes < 4 and dtype.name != "bfloat16" and "f16c" not in flags:
        return "F16C"
    return None


def resolve(name: str, model_dtype: str, device: str = "cpu", flags: frozenset[str] | None = None) -> KVDtype:
    """The KV dtype for `--kv-cache-dtype name` with weights computed in `model_dtype` (float32,
    bfloat16, float16) on `device`. auto: bfloat16 on CPUs with AVX-512 BF16 when the model computes
    in float32 (half the bytes, and the kernel reads bf16 as fast as it widens it), else the model's
    dtype. Raises BriskError for an unknown name or one this CPU cannot run at useful speed."""
    device_type = device.split(":")[0]
    flags = cpu_flags() if flags is None else flags
    if name == "auto":
        if device_type == "cpu" and model_dtype == "float32" and "avx512_bf16" in flags:
            return BFLOAT16
        return DTYPES.get(model_dtype, FLOAT32)
    canonical = ALIASES.get(name, name)
    if canonical not in DTYPES:
        raise BriskError(f"--kv-cache-dtype {name}: unknown; use one of {', '.join(CHOICES)}")
    dtype = DTYPES[canonical]
    missing = _cpu_missing(dtype, flags) if device_type == "cpu" else None
    if missing:
        raise BriskError(f"--kv-cache-dtype {name}: this CPU has no {missing}, which brisk's attention kernel "
                         f"needs to read {dtype.name} at useful speed; use --kv-cache-dtype float32")
    return dtype
