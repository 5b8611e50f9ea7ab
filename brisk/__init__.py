"""brisk: an LLM inference server built against cold start, KV-cache pressure and
context overflow, with the tools to diagnose them on any OpenAI-compatible endpoint."""

__version__ = "0.1.0"

# `brisk.LLM` and `brisk.SamplingParams`, loaded on first use: `import brisk` stays cheap
# (the server opens its socket before torch is imported).
_LAZY = {"LLM": "brisk.llm", "SamplingParams": "brisk.engine.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'brisk' has no attribute {name!r}")
