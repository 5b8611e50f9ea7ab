"""Which instruction-set paths of brisk's compiled kernels this CPU can run, for the tests that pin one.

A test pinned to a path the CPU lacks is skipped with a reason that names the missing flags; the kernels
themselves would run the best path the CPU has instead (`force_isa` takes the minimum), so without the
skip such a test would silently test another path under the missing one's name. Lower paths always run,
on every CPU, so the AVX2 and portable loops are tested on AVX-512 machines too."""

from __future__ import annotations

from pathlib import Path

import pytest

from brisk import kernels
from brisk.kv_dtype import cpu_flags

# the paged attention kernel's levels (paged_attention.cpp attention_isa) and the CPU flags each needs
ATTENTION_PATHS = {0: "portable", 2: "avx2", 3: "avx512", 4: "avx512fp16"}
ATTENTION_FLAGS = {0: (), 2: ("avx2", "fma", "f16c"), 3: ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
                   4: ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_fp16")}
# the matmul kernels' levels (quant_matmul.cpp / half_matmul.cpp brisk_kernels_isa)
MATMUL_PATHS = {0: "scalar", 2: "avx2", 3: "avx512vnni"}
MATMUL_FLAGS = {0: (), 2: ("avx2", "fma", "f16c"), 3: ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")}

# the flags printed in the pytest header and by scripts/cpu_report.py
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                  "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _missing(level: int, flags_by_level: dict[int, tuple[str, ...]]) -> str:
    have = cpu_flags()
    missing = [f for f in flags_by_level[level] if f not in have]
    return ", ".join(missing) if missing else "a flag the kernel's own check looks for"


def attention_level() -> int:
    """The best paged-attention path this CPU runs (whatever a test forced before)."""
    lib = kernels.library()
    lib.brisk_paged_attention_force_isa(-1)
    return lib.brisk_paged_attention_isa()


def force_attention(lib, isa: int) -> None:
    """Pin the paged attention kernel to path `isa`, or skip the test where this CPU lacks it."""
    if isa > attention_level():
        pytest.skip(f"the {ATTENTION_PATHS[isa]} attention path needs {_missing(isa, ATTENTION_FLAGS)}, "
                    "which this CPU lacks; it runs on CPUs that have them")
    lib.brisk_paged_attention_force_isa(isa)


def force_matmul(lib, isa: int) -> None:
    """Pin the matmul kernels to path `isa`, or skip the test where this CPU lacks it."""
    lib.brisk_kernels_force_isa(-1)
    if isa > lib.brisk_kernels_isa():
        pytest.skip(f"the {MATMUL_PATHS[isa]} matmul path needs {_missing(isa, MATMUL_FLAGS)}, which this CPU "
                    "lacks; it runs on CPUs that have them")
    lib.brisk_kernels_force_isa(isa)


def report() -> str:
    """One line: the CPU, its flags that choose kernel paths, and the paths brisk's kernels take here."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    have = cpu_flags()
    flags = " ".join(f for f in REPORTED_FLAGS if f in have) or "none of them"
    lib = kernels.library()
    paths = "kernels not built"
    if lib is not None:
        paths = f"attention {ATTENTION_PATHS[attention_level()]}, matmul {kernels.isa()}"
    return f"CPU: {model or 'unknown'}; ISA flags: {flags}; brisk kernel paths: {paths}"
