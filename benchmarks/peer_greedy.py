"""Greedy tokens of brisk and llama-server on the same GGUF, prompt by prompt (token ids in, token ids out).

    .venv/bin/python benchmarks/peer_greedy.py --llama-server PATH MODEL.gguf [--tokens 24] [--context 256]

A model family's correctness against llama.cpp itself: the prompts are token ids (no template, no tokenizer
in between), longer than a sliding window where the model has one; both servers decode greedily with EOS
ignored. Prints "equal" or both sequences for each prompt; exits 1 when any differs. Random-weight models have
near-flat logits, where a tie broken by float rounding is not a defect: compare the top logprobs there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx


def llama_server_tokens(server: str, gguf: str, prompts: list[list[int]], n: int, context: int, port: int
                        ) -> list[list[int]]:
    proc = subprocess.Popen([server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", str(context),
                             "-np", "1", "--temp", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # 5 minutes at most
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode}")
            time.sleep(0.5)
        else:
            raise SystemExit("llama-server did not become healthy in 5 minutes")
        out = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "return_tokens": True, "cache_prompt": False}
            out.append(httpx.post(f"{url}/completion", json=body, timeout=600).json()["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--port", type=int, default=8931)
    args = parser.parse_args()
    from brisk.engine.sampling_params import SamplingParams
    from brisk.llm import LLM

    lengths = [n for n in (30, 72, 150) if n + args.tokens <= args.context]
    prompts = [[(7 * i + s) % 4000 + 100 for i in range(n)] for s, n in enumerate(lengths)]
    peer = llama_server_tokens(args.llama_server, args.gguf, prompts, args.tokens, args.context, args.port)
    llm = LLM(args.gguf, max_model_len=args.context, num_blocks=4 * args.context // 16)
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0,
                                                                      ignore_eos=True))]
    same = True
    for n, a, b in zip(lengths, peer, ours):
        if a == b:
            print(f"{n}-token prompt: equal ({len(a)} tokens)")
        else:
            same = False
            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) if any(x != y for x, y in zip(a, b)) else 0
            print(f"{n}-token prompt: differs from token {first}\n  llama-server {a}\n  brisk        {b}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
