"""The engine's OpenMP team is the only one in a serving process (brisk.engine.omp_teams).

libgomp keeps a team per thread that ran a parallel region, until that thread exits, and once the
threads it manages outnumber the CPUs its barriers sleep instead of spinning: a Ray Serve replica
that loaded its model on Serve's (long-lived) constructor thread decoded ~1.7x slower for it."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from brisk.engine.omp_teams import call_in_own_thread

REPO = Path(__file__).resolve().parent.parent


def test_call_in_own_thread_returns_the_value_from_another_thread():
    caller = threading.get_ident()
    value, ran_on = call_in_own_thread(lambda x, y=0: (x + y, threading.get_ident()), 2, y=3)
    assert value == 5
    assert ran_on != caller


def test_call_in_own_thread_raises_the_calls_exception_in_the_caller():
    def fail():
        raise KeyError("no such tensor")

    with pytest.raises(KeyError, match="no such tensor"):
        call_in_own_thread(fail)


LOAD_FROM_MAIN_THREAD = r"""
import os, time, torch
from brisk.cli import build_parser
from brisk.engine.factory import load_async_engine
from brisk.loading.report import LoadReport

torch.set_num_threads(2)
args = build_parser().parse_args(["serve", "smollm2-135m-instruct"])
engine = load_async_engine(args, 2048, None, LoadReport())

def threads():
    return len(os.listdir("/proc/self/task"))

stable = threads()
for _ in range(50):  # the engine thread is idle: wait until no thread comes or goes
    time.sleep(0.1)
    now, stable = stable, threads()
    if now == stable:
        break
torch.ones(1 << 22).add_(1)  # a parallel region on this (main) thread: starts a team unless one exists
print("new-team-threads", threads() - stable)
engine.shutdown()
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_loading_for_serve_leaves_no_openmp_team_on_the_calling_thread(brisk_cache):
    """Ray Serve constructs a replica on a thread that lives on; after `load_async_engine` returns,
    that thread must hold no OpenMP team: its first parallel region starts one (one more thread)."""
    done = subprocess.run([sys.executable, "-c", LOAD_FROM_MAIN_THREAD], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "BRISK_CACHE": str(brisk_cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("new-team-threads"))
    assert int(line.split()[1]) == 1, done.stdout
