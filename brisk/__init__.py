"""brisk: an LLM inference server built against cold start, KV-cache pressure and
context overflow, with the tools to diagnose them on any OpenAI-compatible endpoint."""

__version__ = "0.1.0"
