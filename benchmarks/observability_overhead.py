"""Cost of tracing: `brisk serve` at 16 streams with OpenTelemetry export on (to a local
OTLP/HTTP sink that accepts and counts span batches) vs off, alternating runs.
Prometheus metrics are always on in both; their own cost is timed per request below.

    .venv/bin/python benchmarks/observability_overhead.py [--rounds 2] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from serve_load import start_brisk, workload

from brisk.bench.client import run_concurrency
from brisk.bench.metrics import summarize


class _Sink(BaseHTTPRequestHandler):
    batches = 0
    bytes = 0

    def do_POST(self):  # noqa: N802 - http.server's naming
        length = int(self.headers.get("content-length", 0))
        _Sink.bytes += len(self.rfile.read(length))
        _Sink.batches += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def metrics_cost_us(n: int = 2000) -> float:
    """Time of the per-request metric updates the server does (one finished request, 64 tokens)."""
    from brisk.metrics.prometheus import ServerMetrics

    m = ServerMetrics()
    metrics = {"ttft_ms": 50.0, "queue_ms": 1.0, "prefill_ms": 49.0, "decode_ms": 900.0, "e2e_ms": 950.0,
               "itl_ms": [15.0] * 63}
    start = time.perf_counter()
    for _ in range(n):
        m.context_guard.labels("ok").inc()
        m.prompt_tokens.inc(38)
        for _ in range(64):
            m.generation_tokens.inc(1)
        m.observe_finished("length", metrics)
        m.http_responses.labels("/v1/chat/completions", "200").inc()
    return (time.perf_counter() - start) / n * 1e6


def run(url: str, concurrency: int) -> float:
    n = concurrency * 2
    records = asyncio.run(run_concurrency(url, "smollm2-135m-instruct", workload(n, 64, offset=concurrency),
                                          concurrency))
    s = summarize(records)
    assert s.failed == 0, s.errors
    return s.output_throughput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    sink_url = f"http://127.0.0.1:{sink.server_address[1]}"
    results: dict[str, list[float]] = {"off": [], "on": []}
    servers = {"off": start_brisk([]), "on": start_brisk(["--otlp-endpoint", sink_url])}
    try:
        for proc_url in servers.values():
            run(proc_url[1], 4)  # warm-up
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                results[mode].append(run(servers[mode][1], args.concurrency))
                print(f"tracing {mode}: {results[mode][-1]:.1f} tok/s", flush=True)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"| tracing | output tok/s at {args.concurrency} streams (median of {args.rounds}) |")
    print("|---|---|")
    print(f"| off | {off:.1f} |")
    print(f"| on (OTLP/HTTP to a local sink, {_Sink.batches} batches, {_Sink.bytes / 1e3:.0f} kB) | {on:.1f} |")
    print(f"cost of tracing: {(1 - on / off) * 100:+.1f}% throughput")
    print(f"metrics updates per request (64 tokens): {metrics_cost_us():.0f} µs")


if __name__ == "__main__":
    main()
