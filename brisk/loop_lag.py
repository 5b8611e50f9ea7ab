"""How late an asyncio event loop wakes up: a task sleeps `interval_s` over and over and records
how far past the deadline it woke. A busy loop (a CPU-heavy callback, a thread holding the GIL, a
starved process) shows as lag; an idle, responsive loop shows ~0.

Used on both sides: `brisk bench` watches its own client loop (a lagging client would make the
server look slow), and `brisk serve` exports its loop's lag as `brisk:event_loop_lag_seconds`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class LoopLagMonitor:
    """Measures the running loop's wake-up lag. Each lag (seconds) goes to `observe` when given,
    else into `lags_s`."""

    def __init__(self, interval_s: float = 0.01, observe: Callable[[float], None] | None = None):
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self._observe = observe if observe is not None else self.lags_s.append
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self._observe(max(0.0, time.perf_counter() - start - self.interval_s))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    @property
    def p99_ms(self) -> float:
        if not self.lags_s:
            return 0.0
        ordered = sorted(self.lags_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3
