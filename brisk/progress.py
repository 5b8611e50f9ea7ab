"""Progress for long commands: a rich bar on a terminal, plain lines when the output is a file
or a CI log (a bar there is either invisible or thousands of redrawn lines)."""

from __future__ import annotations

import sys
import time


class Progress:
    """`with Progress("concurrency=4", total=64) as p: ... p.advance()`.

    Without a TTY on stderr it prints `label: 16/64 (25%), 12 s` at most every `every_s`
    seconds and once at the end."""

    def __init__(self, label: str, total: int, every_s: float = 5.0, stream=None):
        self.label, self.total, self.every_s = label, max(int(total), 0), every_s
        self.stream = stream or sys.stderr
        self.done = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._rich = None
        self._task = None
        self._start = self._last = 0.0

    def __enter__(self) -> "Progress":
        self._start = self._last = time.monotonic()
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(TextColumn(f"[bold]{self.label}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(file=self.stream), transient=True)
            self._rich.__enter__()
            self._task = self._rich.add_task(self.label, total=self.total)
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._rich is not None:
            self._rich.advance(self._task, n)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._line(now)

    def _line(self, now: float) -> None:
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        print(f"{self.label}: {self.done}/{self.total}{share}, {now - self._start:.0f} s", file=self.stream,
              flush=True)

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
        else:
            self._line(time.monotonic())
