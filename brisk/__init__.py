"""brisk: an LLM inference server built against cold start, KV-cache pressure and
context overflow, with the tools to diagnose them on any OpenAI-compatible endpoint."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# brisk runs fp32 CPU matmuls through OpenBLAS (numpy) and everything else through
# torch. Two thread pools in one step fight unless torch's OpenMP threads sleep
# instead of spinning between parallel regions; measured: 3.8 tok/s spinning vs
# 55 tok/s passive. The policy is read when torch loads, so set it before that.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# `brisk.LLM` and `brisk.SamplingParams`, loaded on first use: `import brisk` stays cheap
# (the server opens its socket before torch is imported).
_LAZY = {"LLM": "brisk.llm", "SamplingParams": "brisk.engine.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'brisk' has no attribute {name!r}")
