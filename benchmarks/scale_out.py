"""Scale-out on Ray Serve (issue: "replicas with prefix-affinity routing"), every figure from one run.

1. Shared prefixes on 2 replicas (1 CPU each): 8 system prompts of ~1,000 tokens, many users each
   (a seeded random interleaving of short questions under them), streamed with greedy 16-token
   replies at fixed concurrency. The same requests go to a fresh cluster routed by brisk's
   prefix-affinity router and to one routed by Ray Serve's default (power of two choices):
   prefix-cache hit rate (prompt tokens reused / looked up, summed over the replicas' /metrics)
   and TTFT p50/p99; affinity with the default --router-max-imbalance (4) and with 1. Each replica's KV pool holds about 5 of the 8 prompts (--kv-cache-memory), as
   a pool smaller than the whole prompt set is what routing has to work around.
2. Overhead of the Ray path: single-process `brisk serve` vs `brisk serve --replicas 1
   --replica-cpus 2` (same cores, same engine), both up at once and measured in interleaved rounds,
   at 1 and 16 streams, short chat prompts, 64-token replies (ignore_eos): output tok/s, TTFT p50.
   `--stream-interval N` passes that flag to the Ray servers; `--replica-stream socket,ray` runs one
   Ray server per transport, all in the same interleaved rounds.

Prints the machine's read bandwidth beside the figures (these machines vary 2x from day to day).

    .venv/bin/python benchmarks/scale_out.py [--parts 1,2] [--requests 64] [--concurrency 8] [--stream-interval 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

from decode_speed import read_bandwidth_gbs  # noqa: E402
from long_context import WORDS, text  # noqa: E402
from quantized_peers import stop  # noqa: E402
from run_peers import free_port, wait_ready  # noqa: E402

from brisk.bench.client import BenchRequest, run_concurrency  # noqa: E402
from brisk.bench.metrics import summarize  # noqa: E402

MODEL_ID = "smollm2-135m-instruct"


def metric_sum(url: str, name: str, label: str | None = None) -> dict[str, float] | float:
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(f"{url}/metrics", timeout=30).text
    samples = [s for f in text_string_to_metric_families(body) for s in f.samples if s.name == name]
    if label is None:
        return sum(s.value for s in samples)
    return {s.labels.get(label, ""): s.value for s in samples}


def start(cmd: list[str], log: Path, replicas: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, model=MODEL_ID)
    deadline = time.monotonic() + 300
    while replicas and metric_sum(url, "brisk:replicas") < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{replicas} replicas never came up (see {log})")
        time.sleep(1)
    return proc, url


def shared_prefix_requests(n: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    systems = [f"You are assistant number {k} of the archive. Rules and reference material:\n"
               + text(900, rng) for k in range(8)]
    out = []
    for i in range(n):
        system = rng.choice(systems)
        question = f"Question {i}: what does the material say about {rng.choice(WORDS)} and {rng.choice(WORDS)}?"
        out.append(BenchRequest(messages=[{"role": "system", "content": system},
                                          {"role": "user", "content": question}],
                                max_tokens=16, extra={"temperature": 0}))
    return out


def part_shared_prefix(args, work: Path) -> list[str]:
    rows = ["| router | requests | streams | prefix-cache hit rate | TTFT mean | TTFT p50 | TTFT p99 | "
            "routed by prefix / load |", "|---|---|---|---|---|---|---|---|"]
    requests = shared_prefix_requests(args.requests)
    for router, imbalance in (("prefix-affinity", 4), ("prefix-affinity", 1), ("pow2", None)):
        cmd = [sys.executable, "-m", "brisk", "serve", MODEL_ID, "--replicas", "2", "--replica-cpus", "1",
               "--max-model-len", "2048", "--kv-cache-memory", args.kv_cache_memory, "--request-router", router]
        if imbalance is not None:
            cmd += ["--router-max-imbalance", str(imbalance)]
            router = f"{router}, max imbalance {imbalance}"
        proc, url = start(cmd, work / f"shared-{len(rows)}.log", replicas=2)
        try:
            q0, h0 = metric_sum(url, "brisk:prefix_cache_queries_total"), metric_sum(url, "brisk:prefix_cache_hits_total")
            records = asyncio.run(run_concurrency(url, MODEL_ID, requests, args.concurrency, timeout_s=3600))
            s = summarize(records)
            q1, h1 = metric_sum(url, "brisk:prefix_cache_queries_total"), metric_sum(url, "brisk:prefix_cache_hits_total")
            decisions = metric_sum(url, "brisk:router_decisions_total", "reason")
        finally:
            stop(proc)
        rows.append(f"| {router} | {s.completed}/{len(requests)} | {args.concurrency} | {(h1 - h0) / max(q1 - q0, 1):.1%} "
                    f"| {s.ttft.mean:.2f} s | {s.ttft.median:.2f} s | {s.ttft.p99:.2f} s | "
                    f"{decisions.get('prefix', 0):.0f} / {decisions.get('load', 0):.0f} |")
        print(rows[-1], flush=True)
    return rows


def part_overhead(args, work: Path) -> list[str]:
    """All servers up at once (Ray's idle daemons load the machine for all), runs interleaved round
    by round in an order that rotates, so the machine's drift hits them alike; each Ray server's
    ratio is the median of its rounds' ratios to one process."""
    base = [sys.executable, "-m", "brisk", "serve", MODEL_ID, "--max-model-len", "2048", "--kv-cache-memory", "1GiB"]
    one = "one process"
    systems = {one: (base, None)}
    for transport in args.replica_stream.split(","):
        cmd = [*base, "--replicas", "1", "--replica-cpus", str(os.cpu_count() or 2), "--replica-stream", transport]
        if args.stream_interval != 1:
            cmd += ["--stream-interval", str(args.stream_interval)]
        systems[f"Ray, --replica-stream {transport}"] = (cmd, 1)
    rays = [name for name in systems if name != one]
    rng = random.Random(1)
    procs, urls = [], {}
    try:
        for i, (name, (cmd, replicas)) in enumerate(systems.items()):
            proc, urls[name] = start(cmd, work / f"overhead-{i}.log", replicas)
            procs.append(proc)
        rows = ["| streams | block | " + " | ".join(f"{name} tok/s" for name in systems) + " | "
                + " | ".join(f"ratio {name}" for name in rays) + " | TTFT p50 " + " / ".join(systems) + " |",
                "|---" * (3 + 2 * len(rays)) + "|---|"]
        # This machine's speed drifts within seconds (one process alone: 121-149 tok/s between 12 s
        # rounds), so at one stream the servers alternate every 2 requests (~1 s; 40 rounds, the order
        # rotating) and a row sums 10 rounds; at 16 streams a row is one round of 32 requests.
        for streams, n, rounds, per_row in ((1, 2, 10 * args.rounds, 10), (16, 32, args.rounds, 1)):
            requests = [BenchRequest(messages=[{"role": "user", "content": text(12, rng)}], max_tokens=64,
                                     extra={"temperature": 0, "ignore_eos": True}) for _ in range(n)]
            for url in urls.values():  # warm-up
                asyncio.run(run_concurrency(url, MODEL_ID, requests[:2], min(2, streams), timeout_s=600))
            ratios: dict[str, list[float]] = {name: [] for name in rays}
            totals = {name: [0, 0.0] for name in systems}  # output tokens, seconds: the whole level
            for block in range(rounds // per_row):
                sums = {name: [0, 0.0] for name in systems}
                ttfts: dict[str, list[float]] = {name: [] for name in systems}
                for r in range(block * per_row, (block + 1) * per_row):
                    names = list(urls)
                    order = names[r % len(names):] + names[:r % len(names)]  # no server always first
                    for name in order:
                        got = summarize(asyncio.run(run_concurrency(urls[name], MODEL_ID, requests, streams,
                                                                    timeout_s=1800)))
                        for acc in (sums[name], totals[name]):
                            acc[0] += got.total_output_tokens
                            acc[1] += got.duration_s
                        ttfts[name].append(got.ttft.median)
                tps = {name: sums[name][0] / sums[name][1] for name in systems}
                for name in rays:
                    ratios[name].append(tps[name] / tps[one])
                rows.append(f"| {streams} | {block + 1} | " + " | ".join(f"{tps[name]:.1f}" for name in systems) + " | "
                            + " | ".join(f"{ratios[name][-1]:.2f}x" for name in rays) + " | "
                            + " / ".join(f"{statistics.median(ttfts[name]) * 1e3:.0f}" for name in systems) + " ms |")
                print(rows[-1], flush=True)
            overall = {name: totals[name][0] / totals[name][1] for name in systems}
            rows.append(f"| {streams} | all | " + " | ".join(f"{overall[name]:.1f}" for name in systems) + " | "
                        + " | ".join(f"**{overall[name] / overall[one]:.2f}x** (median row "
                                     f"{statistics.median(ratios[name]):.2f}x)" for name in rays) + " | |")
            print(rows[-1], flush=True)
    finally:
        for proc in procs:
            stop(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="1,2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4,
                        help="part 2's table rows per concurrency (16 streams: a round of 32 requests each; "
                             "1 stream: 10 rounds of 2 requests each); the servers' order rotates")
    parser.add_argument("--kv-cache-memory", default="224MiB", help="per replica (default: ~5 of the 8 prompts)")
    parser.add_argument("--stream-interval", type=int, default=1, help="part 2: the Ray server's --stream-interval")
    parser.add_argument("--replica-stream", default="socket",
                        help="part 2: one Ray server per --replica-stream value, comma-separated (socket,ray)")
    args = parser.parse_args()
    gbs, _ = read_bandwidth_gbs()
    print(f"read bandwidth: {gbs:.1f} GB/s, {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        parts = args.parts.split(",")
        tables = []
        if "1" in parts:
            tables.append(part_shared_prefix(args, work))
        if "2" in parts:
            tables.append(part_overhead(args, work))
    for table in tables:
        print()
        print("\n".join(table))


if __name__ == "__main__":
    main()
