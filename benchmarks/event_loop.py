"""Does the engine thread's Python cost the event loop? (issue 13, item 6: "measure the GIL").

brisk's engine steps on a background thread of the server process; the event loop that writes
tokens to the sockets shares the GIL (and, on a small CPU, the cores) with it. This measures, at 64
long-context streams, how long a token waits between the end of the engine step that produced it
and the moment its SSE chunk is handed to the socket, from the server's own histograms:

  brisk:token_delivery_seconds{stage="dequeued"}  step end -> taken by its HTTP request on the loop
  brisk:token_delivery_seconds{stage="written"}   step end -> its SSE chunk written to the socket
  brisk:event_loop_lag_seconds                    how late the loop wakes for a 50 ms timer

and puts them beside the inter-token latency the client sees (the step time): a delivery delay that
is a small share of the step means the loop keeps up and a separate engine process (vLLM v1's
EngineCore) would buy nothing here; a large share means it would.

Workload: one shared ~1,900-token document + a unique question per request (prefilled once, then
served from the prefix cache, so the run is decode of 64 rows of ~1,900-2,000 tokens of context),
64 streams, 64 requests, 128-token replies, greedy, ignore_eos. Each `--niceness` value is one
server (BRISK_ENGINE_NICENESS: 0 = the engine thread at the loop's priority).

    .venv/bin/python benchmarks/event_loop.py [--niceness 5,0] [--streams 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from decode_speed import read_bandwidth_gbs  # noqa: E402
from long_context import WORDS, text  # noqa: E402
from serve_load import start_brisk  # noqa: E402

from brisk.bench.client import BenchRequest, run_concurrency  # noqa: E402
from brisk.bench.metrics import summarize  # noqa: E402
from brisk.loop_lag import LoopLagMonitor  # noqa: E402

MODEL_ID = "smollm2-135m-instruct"
SERIES = {"dequeued": ("brisk:token_delivery_seconds", {"stage": "dequeued"}),
          "written": ("brisk:token_delivery_seconds", {"stage": "written"}),
          "loop lag": ("brisk:event_loop_lag_seconds", {})}


def buckets(url: str) -> dict[str, list[tuple[float, float]]]:
    """Each series' cumulative histogram buckets as (upper bound, count)."""
    body = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, list[tuple[float, float]]] = {key: [] for key in SERIES}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            for key, (name, labels) in SERIES.items():
                wanted = sample.name == name + "_bucket"
                if wanted and all(sample.labels.get(k) == v for k, v in labels.items()):
                    out[key].append((float(sample.labels["le"]), sample.value))
    return {key: sorted(rows) for key, rows in out.items()}


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over the difference of two scrapes (linear within a bucket)."""
    counts = [(le, a - b) for (le, a), (_, b) in zip(after, before)]
    total = counts[-1][1] if counts else 0
    if total <= 0:
        return None
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in counts:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def requests(streams: int, max_tokens: int) -> tuple[BenchRequest, list[BenchRequest]]:
    rng = random.Random(0)
    document = text(1850, rng)

    def ask(question: str, tokens: int) -> BenchRequest:
        return BenchRequest(messages=[{"role": "user", "content": f"Document:\n{document}\n\n{question}"}],
                            max_tokens=tokens, extra={"ignore_eos": True, "temperature": 0})

    warm = ask("Question: what is this?", 1)
    return warm, [ask(f"Question {i}: what does the document say about {rng.choice(WORDS)} and "
                      f"{rng.choice(WORDS)}?", max_tokens) for i in range(streams)]


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.2f} ms"


def run(niceness: int, args) -> str:
    env_before = os.environ.get("BRISK_ENGINE_NICENESS")
    os.environ["BRISK_ENGINE_NICENESS"] = str(niceness)
    try:
        proc, url, _ = start_brisk(["--max-model-len", "4096", "--max-num-seqs", str(args.streams),
                                    "--kv-cache-memory", args.kv_cache_memory])
    finally:
        if env_before is None:
            os.environ.pop("BRISK_ENGINE_NICENESS", None)
        else:
            os.environ["BRISK_ENGINE_NICENESS"] = env_before
    try:
        warm, load = requests(args.streams, args.max_tokens)
        asyncio.run(run_concurrency(url, MODEL_ID, [warm], 1, timeout_s=600))  # the document, prefilled once
        before = buckets(url)
        monitor = LoopLagMonitor()
        records = asyncio.run(run_concurrency(url, MODEL_ID, load, args.streams, timeout_s=1800, monitor=monitor))
        after = buckets(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    s = summarize(records)
    q = {key: (quantile(before[key], after[key], 0.5), quantile(before[key], after[key], 0.99)) for key in SERIES}
    written_share = q["written"][0] / s.itl.median if q["written"][0] is not None and s.itl.median else None
    share = "n/a" if written_share is None else f"{written_share:.1%}"
    return (f"| {niceness} | {s.total_input_tokens / max(s.completed, 1):.0f} | {s.output_throughput:.1f} | "
            f"{s.itl.median * 1e3:.0f} ms | {ms(q['dequeued'][0])} / {ms(q['dequeued'][1])} | "
            f"{ms(q['written'][0])} / {ms(q['written'][1])} | {share} | "
            f"{ms(q['loop lag'][0])} / {ms(q['loop lag'][1])} | {monitor.p99_ms:.1f} ms | {s.failed} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--niceness", default="5,0", help="BRISK_ENGINE_NICENESS values, one server each")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-memory", default="8GiB")
    args = parser.parse_args()
    bandwidth, how = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}); {os.cpu_count()} CPUs; {args.streams} streams, "
          f"{args.max_tokens}-token replies over a shared ~1,900-token document")
    print("| engine niceness | prompt tokens | output tok/s | client ITL p50 | step end -> dequeued p50 / p99 "
          "| step end -> written p50 / p99 | written p50 / ITL p50 | server loop lag p50 / p99 "
          "| client loop lag p99 | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for niceness in (int(x) for x in args.niceness.split(",")):
        print(run(niceness, args), flush=True)


if __name__ == "__main__":
    main()
