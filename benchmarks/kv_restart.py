"""Cached prompts across a restart: time to first token of a request with a long shared prefix, right after
`brisk serve` was stopped (SIGTERM) and started again, with and without the KV disk tier (--kv-cache-dir).

For each mode: start the server, send a chat whose system prompt is ~--prefix-tokens tokens (question A),
SIGTERM it, start it again on the same model (and, with the tier, the same folder), send the same system prompt
with question B. Reported: TTFT of A (cold: nothing cached), TTFT of B after the restart, and B's cached prompt
tokens. Without the tier the restart forgets the prefix (B is cold again); with it, B reads the prefix back.

    .venv/bin/python benchmarks/kv_restart.py [--model smollm2-135m-instruct | --shape tinyllama] \\
        [--prefix-tokens 8000] [--work DIR]

`--shape tinyllama`: a TinyLlama-shaped (1.1B) random-weight Q4_0 GGUF with the demo tokenizer (as
quantized_peers.py writes it), instead of the demo model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

from decode_speed import read_bandwidth_gbs  # noqa: E402
from quantized_peers import model_path, wait_health  # noqa: E402
from run_peers import free_port  # noqa: E402

WORDS = ("the service manual describes how each part of the bicycle is inspected adjusted and replaced "
         "including brakes gears wheels tyres chains bearings cables and the frame itself").split()


def system_prompt(words: int) -> str:
    rng = np.random.default_rng(0)
    return "You answer from this manual.\n" + " ".join(rng.choice(WORDS, words))


def start(model: str, args, disk: Path | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "brisk", "serve", model, "--port", str(port), "--max-model-len",
           str(min(args.prefix_tokens + 512, 8192)), "--kv-cache-memory", "1GiB"]
    if disk is not None:
        cmd += ["--kv-cache-dir", str(disk)]
    proc = subprocess.Popen(cmd, stdout=open(args.work / "kv_restart.log", "a"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc, "/ready")
    return proc, url


def ask(url: str, system: str, question: str) -> tuple[float, int, int]:
    """(TTFT in s, prompt tokens, cached prompt tokens) of one streamed greedy chat."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start_s, ttft, usage = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start_s
            if event.get("usage"):
                usage = event["usage"]
    return ttft, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--shape", default=None, choices=["tinyllama"])
    parser.add_argument("--prefix-tokens", type=int, default=8000)
    parser.add_argument("--work", type=Path, default=HERE / "peers" / ".work")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = str(model_path("Q4_0", args.work, args.shape, None)) if args.shape else args.model
    bandwidth, how = read_bandwidth_gbs()
    print(f"machine read bandwidth: {bandwidth:.1f} GB/s ({how}); model {Path(model).name}", flush=True)
    words = int(args.prefix_tokens / 1.04)  # ~1.04 tokens a word of WORDS in the demo vocabulary (measured)
    print("| mode | prompt tokens | TTFT, cold | TTFT after SIGTERM + restart | cached after restart | cold / restart |")
    print("|---|---|---|---|---|---|")
    for mode in ("no tier", "--kv-cache-dir"):
        folder = Path(tempfile.mkdtemp(prefix="kv-restart-", dir=args.work)) if mode != "no tier" else None
        try:
            proc, url = start(model, args, folder)
            try:
                system = system_prompt(words)
                cold, tokens, _ = ask(url, system, "Question A: how are brakes adjusted?")
            finally:
                stop(proc)
            proc, url = start(model, args, folder)
            try:
                warm, _, cached = ask(url, system, "Question B: how is a chain replaced?")
            finally:
                stop(proc)
            print(f"| {mode} | {tokens} | {cold:.2f} s | {warm:.2f} s | {cached} | {cold / warm:.1f}x |", flush=True)
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
