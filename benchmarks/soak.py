"""Soak: thousands of mixed requests against one `brisk serve` process; RSS must stay flat
after warm-up and no KV block may leak.

The mix (seeded, so every run sends the same traffic): short chats, long prompts (about
0.2-0.6k tokens of text), streamed and not, multi-prompt completions, /tokenize calls, and
clients that leave early (a stream closed after a few chunks, a non-streaming request
abandoned by a short client timeout). Prompt lengths vary widely, so the engine sees
every row count, which is what grew RSS in oneDNN's per-row-count kernel cache.

The server's RSS (/proc/PID/status VmRSS) is sampled every 250 requests, with the part of it
that is the KV pool (`brisk:kv_cache_resident_bytes`: the pool's pages are mapped on first write,
so resident memory grows until every block has been used once). The report separates the two:
- pool fill: the pool's resident bytes, and the request count at which all of it was touched;
- growth: RSS from the first sample with the pool fully touched to the end (the verdict, with how
  many requests that window spans), and RSS less the pool from the warm-up to the end.
A leak shows in both; a pool still filling shows only in the first. At the end, with the server
idle, `brisk:kv_blocks_used` must be 0 and running/waiting 0.

    .venv/bin/python benchmarks/soak.py [--requests 5000] [--warmup 1000] [--concurrency 16]
        [-- extra brisk serve flags, e.g. --quantization none]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import start_brisk  # noqa: E402

WORDS = ("lighthouse keeper storm ocean harbour lantern rope gull tide reef compass chart mast sail "
         "anchor fog bell cliff wave island").split()


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_request(rng: random.Random, i: int) -> tuple[str, str, dict, float | None]:
    """(kind, path, body, client timeout or None). Prompts are salted with i: no two alike."""
    r = rng.random()
    salt = f"[{i}] "
    if r < 0.50:  # short chat
        body = {"messages": [{"role": "user", "content": salt + text(rng, rng.randint(3, 30))}],
                "max_tokens": rng.randint(2, 16), "temperature": rng.choice([0, 0.7])}
        return "short", "/v1/chat/completions", {**body, "stream": rng.random() < 0.5}, None
    if r < 0.54:  # long prompt (hundreds of tokens)
        body = {"messages": [{"role": "system", "content": "Summarize."},
                             {"role": "user", "content": salt + text(rng, rng.randint(150, 500))}],
                "max_tokens": rng.randint(2, 8), "temperature": 0}
        return "long", "/v1/chat/completions", {**body, "stream": rng.random() < 0.5}, None
    if r < 0.68:  # completions, sometimes several prompts
        prompts = [salt + text(rng, rng.randint(5, 100)) for _ in range(rng.choice([1, 1, 2, 3]))]
        body = {"prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": rng.randint(1, 16),
                "stream": rng.random() < 0.3}
        return "completion", "/v1/completions", body, None
    if r < 0.80:
        return "tokenize", "/tokenize", {"prompt": salt + text(rng, rng.randint(10, 3000))}, None
    if r < 0.90:  # a stream the client leaves after a few chunks
        body = {"messages": [{"role": "user", "content": salt + text(rng, rng.randint(5, 100))}],
                "max_tokens": 200, "ignore_eos": True, "stream": True}
        return "stream_disconnect", "/v1/chat/completions", body, None
    body = {"messages": [{"role": "user", "content": salt + text(rng, rng.randint(5, 100))}],
            "max_tokens": 200, "ignore_eos": True}  # abandoned by a short client timeout
    return "timeout_disconnect", "/v1/chat/completions", body, rng.uniform(0.2, 1.0)


async def send(client: httpx.AsyncClient, kind: str, path: str, body: dict, timeout: float | None) -> str:
    try:
        if kind == "stream_disconnect":
            async with client.stream("POST", path, json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break
                return f"{r.status_code}-left"
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as r:
                async for _ in r.aiter_lines():
                    pass
                return str(r.status_code)
        r = await client.post(path, json=body, timeout=timeout or 300)
        return str(r.status_code)
    except httpx.TimeoutException:
        return "client-timeout"


async def metric_values(client: httpx.AsyncClient) -> dict[str, float]:
    metrics = (await client.get("/metrics")).text
    return {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
            if line and not line.startswith("#") and len(line.split()) == 2}


async def sample(client: httpx.AsyncClient, pid: int, count: int) -> tuple[int, float, float]:
    """(requests done, RSS MB, KV pool resident MB)"""
    pool = (await metric_values(client)).get("brisk:kv_cache_resident_bytes", 0.0) / 2**20
    return count, rss_mb(pid), pool


async def run(url: str, pid: int, n: int, warmup: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    requests = [make_request(rng, i) for i in range(n)]
    statuses: dict[str, int] = {}
    next_index = 0
    done = 0
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        first = await metric_values(client)
        pool_mb = first.get("brisk:kv_cache_bytes", 0.0) / 2**20
        samples: list[tuple[int, float, float]] = [await sample(client, pid, 0)]

        async def worker():
            nonlocal next_index, done
            while next_index < n:
                kind, path, body, timeout = requests[next_index]
                next_index += 1
                status = await send(client, kind, path, body, timeout)
                statuses[f"{kind}:{status}"] = statuses.get(f"{kind}:{status}", 0) + 1
                done += 1
                if done % 250 == 0:
                    samples.append(await sample(client, pid, done))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        deadline = time.monotonic() + 60
        while True:  # the server notices the last disconnects within its poll interval
            values = await metric_values(client)
            busy = values.get("brisk:num_requests_running", 0) + values.get("brisk:num_requests_waiting", 0)
            if (busy == 0 and values.get("brisk:kv_blocks_used", 0) == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        samples.append(await sample(client, pid, n))
    warm = next(s for s in samples if s[0] >= warmup)
    end = samples[-1]
    # the pool counts as touched within one huge page per layer slice of K and of V
    full = next((s for s in samples if pool_mb and s[2] >= pool_mb * 0.99), None)
    return {"requests": n, "elapsed_s": round(elapsed, 1), "req_per_s": round(n / elapsed, 1),
            "rss_start_mb": round(samples[0][1]), "rss_after_warmup_mb": round(warm[1]),
            "rss_end_mb": round(end[1]), "rss_max_mb": round(max(s[1] for s in samples)),
            "growth_after_warmup_pct": round((end[1] - warm[1]) / warm[1] * 100, 2),
            "kv_pool_mb": round(pool_mb), "kv_pool_resident_end_mb": round(end[2]),
            "pool_full_after_requests": full[0] if full else None,
            "requests_after_pool_full": n - full[0] if full else 0,
            "growth_after_pool_full_pct": round((end[1] - full[1]) / full[1] * 100, 2) if full else None,
            "rss_less_pool_after_warmup_mb": round(warm[1] - warm[2]), "rss_less_pool_end_mb": round(end[1] - end[2]),
            "growth_less_pool_after_warmup_pct": round(((end[1] - end[2]) - (warm[1] - warm[2]))
                                                       / (warm[1] - warm[2]) * 100, 2),
            "kv_blocks_used_at_end": values.get("brisk:kv_blocks_used"),
            "running_waiting_at_end": busy,
            "aborts": {k.split('cause="')[1].rstrip('"}'): v for k, v in values.items()
                       if k.startswith("brisk:request_aborts_total")},
            "http_5xx": sum(v for k, v in values.items() if k.startswith("brisk:http_responses_total")
                            and 'status="5' in k and 'route="/ready"' not in k),  # /ready: 503 while loading
            "http_statuses": {k.split("{")[1].rstrip("}"): v for k, v in values.items()
                              if k.startswith("brisk:http_responses_total")},
            "statuses": dict(sorted(statuses.items())),
            "samples_requests_rss_pool_mb": [(c, round(r), round(p)) for c, r, p in samples]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--server-log", default=None, help="keep the server's log in this file")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    proc, url, ready_s = start_brisk(extra, args.server_log)
    try:
        result = asyncio.run(run(url, proc.pid, args.requests, args.warmup, args.concurrency, args.seed))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result["serve_flags"] = " ".join(extra) or "(defaults)"
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    r = result
    full = (f"after {r['pool_full_after_requests']} requests" if r["pool_full_after_requests"] is not None
            else "never (run longer or give a smaller --kv-cache-memory)")
    print(f"\n| serve flags | requests | req/s | KV pool MB | pool fully touched | RSS growth after (requests) | "
          f"RSS less pool: growth after warm-up | max RSS MB | KV blocks used at end | 5xx |")
    growth = (f"{r['growth_after_pool_full_pct']}% ({r['requests_after_pool_full']})"
              if r["growth_after_pool_full_pct"] is not None else "-")
    print(f"| {r['serve_flags']} | {r['requests']} | {r['req_per_s']} | {r['kv_pool_mb']} | {full} | {growth} | "
          f"{r['growth_less_pool_after_warmup_pct']}% | {r['rss_max_mb']} | {r['kv_blocks_used_at_end']:g} | "
          f"{r['http_5xx']:g} |")


if __name__ == "__main__":
    main()
