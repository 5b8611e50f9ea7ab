"""The log lines people expect from a server (vLLM and llama-server print both): one access line
per request, and a periodic engine line while it is busy."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

access_log = logging.getLogger("brisk.access")
stats_log = logging.getLogger("brisk.stats")


def access_line(scope: dict, status: int, total_ms: float, log_prompts: bool) -> str:
    """`127.0.0.1 "POST /v1/chat/completions" 200 prompt=27 completion=16 ttft=85ms total=512ms`;
    token counts and TTFT when the route generated (the handler leaves them in the request's
    state), the prompt text only with --log-prompts."""
    client = (scope.get("client") or ("-",))[0]
    line = f'{client} "{scope.get("method", "-")} {scope.get("path", "-")}" {status}'
    usage: dict[str, Any] = (scope.get("state") or {}).get("brisk_access") or {}
    if usage:
        line += f" prompt={usage['prompt_tokens']} completion={usage['completion_tokens']}"
        if usage.get("ttft_ms") is not None:
            line += f" ttft={usage['ttft_ms']:.0f}ms"
        if usage.get("finish"):
            line += f" finish={usage['finish']}"
    line += f" total={total_ms:.0f}ms"
    if log_prompts and usage.get("prompt") is not None:
        line += f" prompt_text={usage['prompt']!r}"
    return line


class EngineStatsLogger:
    """Every `interval_s` while the engine has work (or did some since the last line): prompt and
    generation tokens/s, running and waiting requests, KV usage, prefix-cache hit rate."""

    def __init__(self, engine, interval_s: float):
        self.engine, self.interval_s = engine, interval_s
        self.last = None

    def line(self, now, elapsed_s: float) -> str | None:
        prev, self.last = self.last, now
        if prev is None:
            return None
        prompt = now.prompt_tokens - prev.prompt_tokens
        generated = now.generation_tokens - prev.generation_tokens
        if not (prompt or generated or now.num_running or now.num_waiting):
            return None  # idle: no line
        queried = now.prefix_cache_queries_tokens - prev.prefix_cache_queries_tokens
        hits = now.prefix_cache_hits_tokens - prev.prefix_cache_hits_tokens
        hit_rate = f"{hits / queried:.1%}" if queried else "-"
        return (f"prompt {prompt / elapsed_s:.1f} tok/s, generation {generated / elapsed_s:.1f} tok/s, "
                f"running {now.num_running}, waiting {now.num_waiting}, KV usage {now.kv_usage:.1%}, "
                f"prefix-cache hits {hit_rate}, preemptions {now.num_preemptions - prev.num_preemptions}")

    async def _stats(self):
        return await self.engine.stats()  # behind Ray Serve: every replica's, combined (one line)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        before = loop.time()
        self.last = await self._stats()
        while True:
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            text = self.line(await self._stats(), now - before)
            before = now
            if text:
                stats_log.info("%s", text)
