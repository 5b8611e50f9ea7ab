"""How many long sequences run at once in the same KV memory, per KV cache dtype, counted from the
server under load (issue: "KV cache in bf16, fp8 and int8").

For each dtype: `brisk serve --kv-cache-dtype D --kv-cache-memory M --max-model-len 4096` on the
demo model; --requests concurrent completions, each a unique ~4,000-token prompt (token ids) and
64 greedy tokens (ignore_eos; --prompt-tokens, --max-tokens), so that every sequence ends at ~4,064
tokens. With 64, the first requests can finish before the last are prefilled, so a roomy pool is not
filled: give a 1-byte dtype's count --prompt-tokens 3500 --max-tokens 590. While they run,
/metrics is read every 0.2 s. Reported:
  running      the peak of brisk:num_requests_running
  decoding     the peak number of requests between their first and last token at once (client
               side: a request in decode holds its whole ~4,000-token context)
  KV held      the peak of brisk:kv_blocks_used x block size / 4,096 (sequences' worth of KV)
  preemptions  brisk:num_preemptions_total at the end (none means nobody was admitted and evicted)

    .venv/bin/python benchmarks/kv_capacity.py [--memory 512MiB] [--requests 16] [--prompt-tokens 4000]
        [--max-tokens 64]
        [--kv-dtype float32 bfloat16 fp8 int8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

from quantized_peers import stop  # noqa: E402
from run_peers import free_port, wait_ready  # noqa: E402

MODEL_ID = "smollm2-135m-instruct"


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith("brisk:") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def one(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, spans: list) -> None:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    first = None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]" and first is None:
                if json.loads(line[5:])["choices"][0].get("text"):
                    first = time.perf_counter()
    spans.append((first, time.perf_counter()))


async def load(url: str, prompts: list[list[int]], max_tokens: int) -> list:
    spans: list = []
    async with httpx.AsyncClient(timeout=3600) as http:
        await asyncio.gather(*(one(http, url, p, max_tokens, spans) for p in prompts))
    return spans


def peak_overlap(spans: list) -> int:
    events = sorted([(a, 1) for a, _ in spans if a] + [(b, -1) for a, b in spans if a])
    now = best = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


def run(dtype: str, args, prompts: list[list[int]]) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(args.work / f"capacity-{dtype}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "brisk", "serve", "--port", str(port), "--kv-cache-dtype", dtype,
                             "--kv-cache-memory", args.memory, "--max-model-len", "4096", "--max-num-seqs", "64"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, model=MODEL_ID)
        m0 = metrics(url)
        block_size = 8  # brisk serve's default --block-size
        peak = {"running": 0.0, "blocks": 0.0}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                try:
                    m = metrics(url)
                except httpx.HTTPError:  # a slow scrape under load: the next one counts
                    continue
                peak["running"] = max(peak["running"], m.get("brisk:num_requests_running", 0))
                peak["blocks"] = max(peak["blocks"], m.get("brisk:kv_blocks_used", 0))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        t = time.perf_counter()
        spans = asyncio.run(load(url, prompts, args.max_tokens))
        elapsed = time.perf_counter() - t
        done.set()
        watcher.join()
        m = metrics(url)
        held = peak["blocks"] * block_size / 4096
        return (f"| {dtype} | {m0['brisk:kv_cache_bytes'] / 2**20:.0f} MiB | {m0['brisk:kv_num_blocks']:.0f} | "
                f"{peak['running']:.0f} | {peak_overlap(spans)} | {held:.2f} | "
                f"{m.get('brisk:num_preemptions_total', 0):.0f} | {elapsed:.0f} s |")
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", default="512MiB")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens generated a request: with few, the first requests may finish before the last "
                             "are prefilled, and the count is of the workload's timing rather than of the memory")
    parser.add_argument("--kv-dtype", nargs="+", default=["float32", "bfloat16", "fp8", "int8"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/brisk-kv-capacity"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    print(f"--kv-cache-memory {args.memory}, {args.requests} concurrent requests of {args.prompt_tokens} prompt "
          f"tokens + {args.max_tokens} generated (~{args.prompt_tokens + args.max_tokens:,}-token sequences), "
          f"--max-model-len 4096")
    print("| KV dtype | pool | blocks | peak running | peak decoding at once | peak KV held (4,096-token seqs) "
          "| preemptions | wall |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for dtype in args.kv_dtype:
        print(run(dtype, args, prompts), flush=True)


if __name__ == "__main__":
    main()
