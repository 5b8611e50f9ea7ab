"""bfloat16/float16 weights through half_matmul.cpp against float32 weights on oneDNN (brisk's
float path, weights packed once), per row count, on TinyLlama's linear shapes.

Two 16-bit layouts: `rows` (the checkpoint's [N, K], dot-product tiles; tied LM heads read the
embedding table so) and `panels` (what linears are packed into at load, `brisk.kernels.pack_half`).
A row count of 1 is single-stream decode (memory-bound: half the bytes should give up to 2x);
16-256 rows are batched decode and prompt chunks (compute-bound). The three paths take turns,
five rounds, and each cell is its best round (this host's speed drifts within a minute). Ratios:
oneDNN time / 16-bit time (above 1, the 16-bit weights are faster).

    .venv/bin/python benchmarks/half_matmul.py [--rows 1,4,16,64,256] [--dtype bfloat16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from brisk import kernels
from brisk.models.linear import Linear

SHAPES = [(5632, 2048), (2048, 2048), (2048, 5632)]  # gate/up, q/o, down of a 1.1B Llama


def seconds(fn, iterations: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    half = getattr(torch, args.dtype)
    print(f"kernels: {kernels.isa()}, threads: {torch.get_num_threads()}, best of {args.rounds} interleaved rounds")
    print("| N x K | rows | oneDNN float32 ms | rows layout ms | panels ms | panels vs oneDNN | panels vs rows "
          "| panels GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        weight = torch.randn(n, k) * 0.02
        layer = Linear(k, n, bias=False)
        layer.weight.data = weight
        layer.prepare()
        stored = weight.to(half)
        panels = kernels.pack_half(stored)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            iterations = 10 if rows <= 16 else 3
            paths = {"f32": lambda: layer(x), "rows": lambda: kernels.half_matmul(x, stored),
                     "panels": lambda: kernels.half_matmul(x, panels, n)}
            best = {name: float("inf") for name in paths}
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    best[name] = min(best[name], seconds(fn, iterations))
            f32, r, p = best["f32"], best["rows"], best["panels"]
            print(f"| {n} x {k} | {rows} | {f32 * 1e3:.2f} | {r * 1e3:.2f} | {p * 1e3:.2f} | {f32 / p:.2f} | "
                  f"{r / p:.2f} | {2 * rows * n * k / p / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
