"""bfloat16/float16 weights through half_matmul.cpp against float32 weights on oneDNN (brisk's
float path, weights packed once), per row count, on TinyLlama's linear shapes.

A row count of 1 is single-stream decode (memory-bound: half the bytes should give up to 2x);
16-256 rows are batched decode and prompt chunks (compute-bound: the widening costs). Prints
each path's time, the 16-bit path's weight GB/s and GFLOP/s, and the ratio (oneDNN time / 16-bit
time: above 1, the 16-bit weights are faster).

    .venv/bin/python benchmarks/half_matmul.py [--rows 1,2,4,16,64,256] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from brisk import kernels
from brisk.models.linear import Linear

SHAPES = [(5632, 2048), (2048, 2048), (2048, 5632)]  # gate/up, q/o, down of a 1.1B Llama


def seconds(fn, iterations: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,16,64,256")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = parser.parse_args()
    half = getattr(torch, args.dtype)
    print(f"kernels: {kernels.isa()}, threads: {torch.get_num_threads()}")
    print("| N x K | rows | oneDNN float32 ms | 16-bit ms | ratio | 16-bit GB/s | 16-bit GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        weight = torch.randn(n, k) * 0.02
        layer = Linear(k, n, bias=False)
        layer.weight.data = weight
        layer.prepare()
        stored = weight.to(half)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            iterations = 40 if rows <= 16 else 8
            f32 = seconds(lambda: layer(x), iterations)
            h = seconds(lambda: kernels.half_matmul(x, stored), iterations)
            print(f"| {n} x {k} | {rows} | {f32 * 1e3:.2f} | {h * 1e3:.2f} | {f32 / h:.2f} | "
                  f"{n * k * 2 / h / 1e9:.1f} | {2 * rows * n * k / h / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
