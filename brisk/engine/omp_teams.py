"""Run a call in a thread of its own that exits when it returns, so that the OpenMP thread team any
torch op (or brisk kernel) starts there goes away with it.

Why it matters: libgomp keeps one team of worker threads per thread that ever ran a parallel
region, until that thread exits, and it spins at barriers only while the threads it manages number
no more than the CPUs; past that it sleeps on a futex at every barrier (its "throttled" spin of 100
rounds). A decode step runs ~150 parallel regions, so those sleeps cost milliseconds a step.
A Ray Serve replica loaded the model in Serve's constructor thread, which lives on: two teams of
two threads on 2 cores, and the engine decoded at 13 ms a token where one process took 7.5 ms.
Loading through `call_in_own_thread` leaves the engine thread's team as the only one."""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def call_in_own_thread(fn: Callable[..., T], *args: Any, name: str = "brisk-load", **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a new thread, joined; its exception is raised here."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            outcome.append((False, e))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
