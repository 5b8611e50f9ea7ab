"""Greedy tokens of each family's tiny GGUF (as tests/test_model_families.py builds them: random
weights, converted by llama.cpp's own convert_hf_to_gguf.py) from brisk, from transformers on the HF
directory, and from native `llama-server` on the same GGUF, in one run.

Needs a llama-server built from the llama-cpp-python sdist (DESIGN.md: `cmake --build build --target
llama-server`); pass its path.

    .venv/bin/python benchmarks/llamacpp_agreement.py --llama-server PATH/llama-server
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_model_families import FAMILIES, NEW_TOKENS, _build, brisk_greedy, hf_greedy, prompt_ids  # noqa: E402

from llamacpp import train_sentencepiece  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_greedy(binary: str, gguf: Path, ids: list[int], n: int) -> list[int]:
    port = _port()
    proc = subprocess.Popen([binary, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-c", "256",
                             "-t", "2", "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"llama-server did not start on {gguf}")
            time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=120, json={
            "prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True, "samplers": ["top_k"]})
        r.raise_for_status()
        return r.json()["tokens"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="brisk-agree-"))
    os.environ.setdefault("BRISK_CACHE", str(root / "cache"))
    from brisk.loading.loader import load

    demo = load("smollm2-135m-instruct", warmup=False)
    spm = train_sentencepiece(root / "spm", (Path(__file__).resolve().parent.parent / "README.md").read_text())
    print("| family | greedy tokens: brisk = llama-server | brisk = HF | first difference from llama-server |")
    print("|---|---|---|---|")
    for name, family in FAMILIES.items():
        built = _build(name, family, root / name, demo, spm)
        ids = prompt_ids(built.hf.config.vocab_size)
        ours, hf = brisk_greedy(built.gguf, ids), hf_greedy(built.hf, ids)
        theirs = llama_server_greedy(args.llama_server, built.gguf, ids, NEW_TOKENS)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        print(f"| {name} | {'yes' if ours == theirs else 'NO'} | {'yes' if ours == hf else 'NO'} | "
              f"{'-' if first is None else f'token {first}' + _margin(built.hf, ids + ours[:first])} |", flush=True)


def _margin(hf, ids: list[int]) -> str:
    """HF's gap between its top two next-token logits there: a near-tie that float rounding can flip."""
    import torch

    with torch.inference_mode():
        top = hf(torch.tensor([ids])).logits[0, -1].float().topk(2).values
    return f" (HF's top two logits {float(top[0] - top[1]):.1e} apart, of {float(top[0]):.3f})"


if __name__ == "__main__":
    main()
