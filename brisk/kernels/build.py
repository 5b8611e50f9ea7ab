"""Compiling the C++ kernels: standard library only, so that `setup.py` can load this file in
pip's isolated build environment (no torch there) and `brisk.kernels` can use it at run time."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "quant_matmul.cpp", HERE / "half_matmul.cpp", HERE / "paged_attention.cpp", HERE / "fused_ops.cpp",
           HERE / "decoder.cpp", HERE / "moe.cpp", HERE / "repack.cpp")
HEADERS = (HERE / "simd_avx2.h", HERE / "simd_widen.h", HERE / "brisk_abi.h", HERE / "kv_types.h")
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-march=x86-64", "-Wall"]


def source_tag() -> str:
    """Names the source and flags a library was built from (written beside it as NAME.tag)."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def build(out: Path) -> Path:
    """Compile the kernels into `out` (atomically). Raises CalledProcessError / FileNotFoundError."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (g++/c++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES)], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
        (out.parent / (out.name + ".tag")).write_text(source_tag())
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
