"""Embedding throughput: brisk's /v1/embeddings against `llama-server --embeddings` on the same GGUF, same client,
same run. The model is a random-weight GGUF of Qwen3-Embedding-0.6B's shape (hidden 1024, 28 layers, 16/8 heads x
128, FFN 3072; last-token pooling marked as llama.cpp's converter marks it) with the demo tokenizer, in Q8_0 (the
type Qwen3-Embedding GGUFs ship in); the vectors are noise, the work is real.

Inputs are RAG-sized chunks (--input-tokens, ~128 tokens each). Batch 1: one input per request, requests one after
another; batch 32: 32 inputs per request. Inputs/s over --requests requests after a warm-up, whether each
server's vectors are unit-length (both normalise), and how far apart the two servers' vectors for the same 8
inputs are (cosine distance: the same model file, the same pooling).

    .venv/bin/python benchmarks/embeddings.py --llama-server PATH/llama-server [--work DIR] [--requests 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

from decode_speed import read_bandwidth_gbs  # noqa: E402
from quantized_peers import memory_mb, stop, wait_health  # noqa: E402
from run_peers import free_port  # noqa: E402

WORDS = ("retrieval augmented generation splits documents into chunks embeds each chunk and stores the vectors "
         "so that a question can be matched against them by cosine similarity before the answer is written").split()


def model_path(work: Path) -> Path:
    from brisk.loading.gguf_random import SHAPES, write_random_gguf
    from brisk.models.registry import resolve

    path = work / "qwen3-embedding-0.6b-shape-Q8_0.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        write_random_gguf(tmp, SHAPES["qwen3-embedding-0.6b"], "Q8_0", resolve("smollm2-135m-instruct").path,
                          pooling_type=3)
        tmp.rename(path)
    return path


def inputs(n: int, tokens: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = int(tokens * 0.8)  # ~1.25 tokens a word in this vocabulary
    return [" ".join(rng.choice(WORDS, words)) for _ in range(n)]


def start(system: str, gguf: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if system == "brisk":
        cmd = [sys.executable, "-m", "brisk", "serve", str(gguf), "--port", str(port), "--max-model-len", "1024",
               "--max-num-seqs", "32", "--max-num-batched-tokens", "2048", "--kv-cache-memory", "1GiB"]
    else:
        cmd = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--embeddings",
               "--pooling", "last", "--parallel", "32", "-c", str(32 * 512), "-b", "4096", "-ub", "4096",
               "-t", str(os.cpu_count() or 2)]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc, "/ready" if system == "brisk" else "/health")
    return proc, url


def run(url: str, batch: int, requests: int, tokens: int) -> tuple[float, int, bool]:
    """(inputs/s, prompt tokens, every vector unit-length) over `requests` requests of `batch` inputs."""
    with httpx.Client(base_url=url, timeout=600) as http:
        http.post("/v1/embeddings", json={"input": inputs(batch, tokens, 99)}).raise_for_status()  # warm-up
        start_s, counted, unit = time.perf_counter(), 0, True
        for i in range(requests):
            r = http.post("/v1/embeddings", json={"input": inputs(batch, tokens, i)})
            r.raise_for_status()
            body = r.json()
            counted += body["usage"]["prompt_tokens"]
            unit &= all(abs(np.linalg.norm(d["embedding"]) - 1) < 1e-3 for d in body["data"])
        return batch * requests / (time.perf_counter() - start_s), counted, unit


def vectors(url: str, tokens: int) -> np.ndarray:
    """The vectors of 8 fixed inputs, to compare the two servers' (same GGUF, same pooling)."""
    with httpx.Client(base_url=url, timeout=600) as http:
        r = http.post("/v1/embeddings", json={"input": inputs(8, tokens, 1234)})
        r.raise_for_status()
        return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--work", type=Path, default=HERE / "peers" / ".work")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--input-tokens", type=int, default=128)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    gguf = model_path(args.work)
    bandwidth, how = read_bandwidth_gbs()
    print(f"machine read bandwidth: {bandwidth:.1f} GB/s ({how}); model {gguf.name}", flush=True)
    print("| server | inputs/s @ batch 1 | inputs/s @ batch 32 | prompt tokens per input | unit vectors | RSS |")
    print("|---|---|---|---|---|---|")
    seen: dict[str, np.ndarray] = {}
    for system in ("brisk", "llama-server"):
        proc, url = start(system, gguf, args, args.work / f"embeddings-{system}.log")
        try:
            seen[system] = vectors(url, args.input_tokens)
            one, tokens_one, unit_one = run(url, 1, args.requests, args.input_tokens)
            many, tokens_many, unit_many = run(url, 32, max(args.requests // 4, 2), args.input_tokens)
            rss, _ = memory_mb(proc.pid)
        finally:
            stop(proc)
        print(f"| {system} | {one:.1f} | {many:.1f} | {tokens_one / args.requests:.0f} | "
              f"{'yes' if unit_one and unit_many else 'NO'} | {rss:.0f} MB |", flush=True)
    a, b = seen["brisk"], seen["llama-server"]
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    print(f"the two servers' vectors for 8 inputs: cosine distance at most {float((1 - cosine).max()):.1e}")


if __name__ == "__main__":
    main()
