"""Serving load: a streaming client at fixed concurrency against `brisk serve` (started
here, timed from process start to /ready) or any OpenAI-compatible --url.

Short chat prompts, 64-token replies (ignore_eos), greedy, or with `--sampling chat` what chat
clients send (temperature 0.7, top_p 0.9, top_k 50); metric definitions as in DESIGN.md
(brisk.bench.metrics). Prints a markdown table for benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/serve_load.py [--concurrency 1,16,64] [--url URL --model M]
        [--requests-per-stream 2] [--sampling greedy|chat] [-- extra brisk serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx

from brisk.bench.client import BenchRequest, run_concurrency
from brisk.loop_lag import LoopLagMonitor
from brisk.bench.metrics import summarize

TOPICS = ["rivers", "volcanoes", "bread", "chess", "the moon", "bees", "trains", "jazz", "glaciers", "tea",
          "owls", "bridges", "deserts", "clocks", "whales", "paper"]


SAMPLING = {"greedy": {"temperature": 0}, "chat": {"temperature": 0.7, "top_p": 0.9, "top_k": 50}}


def workload(n: int, max_tokens: int, offset: int = 0, sampling: str = "greedy") -> list[BenchRequest]:
    return [BenchRequest(messages=[{"role": "user", "content": f"Tell me about {TOPICS[(i + offset) % 16]} "
                                                               f"(#{i + offset})."}],
                         max_tokens=max_tokens, extra={"ignore_eos": True, **SAMPLING[sampling]})
            for i in range(n)]


def start_brisk(extra: list[str], log_path: str | None = None) -> tuple[subprocess.Popen, str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "brisk", "serve", "--port", str(port), *extra],
                            stdout=log, stderr=log, env=os.environ.copy())
    deadline = start + 600
    while time.perf_counter() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - start
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"brisk serve exited with {proc.returncode}")
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("brisk serve did not become ready in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--url", default=None)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--label", default="brisk")
    parser.add_argument("--sampling", default="greedy", choices=list(SAMPLING))
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    proc, ready_s = None, None
    url = args.url
    if url is None:
        proc, url, ready_s = start_brisk(extra)
    try:
        asyncio.run(run_concurrency(url, args.model, workload(4, 8), 4))  # warm-up
        print(f"{args.label}: ready after start {ready_s:.2f} s" if ready_s is not None else args.label)
        print("| concurrency | requests | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT median |"
              " failed | client loop lag p99 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for c in (int(x) for x in args.concurrency.split(",")):
            n = max(args.min_requests, c * args.requests_per_stream)
            monitor = LoopLagMonitor()
            requests = workload(n, args.max_tokens, offset=c, sampling=args.sampling)
            records = asyncio.run(run_concurrency(url, args.model, requests, c, monitor=monitor))
            s = summarize(records)
            print(f"| {c} | {n} | {s.output_throughput:.1f} | {s.ttft.median * 1e3:.0f} ms | "
                  f"{s.ttft.p99 * 1e3:.0f} ms | {s.itl.median * 1e3:.1f} ms | {s.itl.p99 * 1e3:.1f} ms | "
                  f"{s.tpot.median * 1e3:.1f} ms | {s.failed} | {monitor.p99_ms:.1f} ms |", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
