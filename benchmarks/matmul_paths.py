"""Per-shape matmul paths for the demo model's linears: torch F.linear vs numpy (OpenBLAS).

For each number of tokens M, runs every linear of one decoder step (all layers +
lm_head) and reports ms and GFLOP/s for both paths. Used to choose
`brisk.models.linear`'s backend and threshold.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/matmul_paths.py
"""

import time

import numpy as np
import torch
import torch.nn.functional as F

from brisk.loading.loader import load


def bench(fn, runs=5):
    fn()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs


def main():
    loaded = load(warmup=False)
    weights = [m.weight for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    arrays = [w.numpy() for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    print(f"{len(weights)} linears, {nbytes / 1e6:.0f} MB of fp32 weights, torch threads {torch.get_num_threads()}")
    print("| tokens | torch F.linear ms | GB/s or GFLOP/s | numpy ms | GB/s or GFLOP/s | numpy speedup |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
            t_torch = bench(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
            t_numpy = bench(lambda: [np.matmul(xs[a.shape[1]].numpy(), a.T) for a in arrays])
            flops = 2 * m * nbytes / 4

            def rate(t):
                return f"{nbytes / t / 1e9:.1f} GB/s" if m == 1 else f"{flops / t / 1e9:.0f} GFLOP/s"

            print(f"| {m} | {t_torch * 1e3:.1f} | {rate(t_torch)} | {t_numpy * 1e3:.1f} | {rate(t_numpy)} "
                  f"| {t_torch / t_numpy:.2f}x |")


if __name__ == "__main__":
    main()
