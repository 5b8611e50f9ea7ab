"""Per-shape matmul paths for the demo model's linears: torch F.linear vs numpy (OpenBLAS).

For each number of tokens M, runs every linear of one decoder step (all layers +
lm_head) and reports ms and GFLOP/s for both paths. Used to choose
`brisk.models.linear`'s backend and threshold.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/matmul_paths.py [--small-rows]
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




def small_rows():
    """2-16 rows (a few concurrent decodes): plain sgemm vs brisk's shaped path (sgemv per
    row up to 4 rows, zero-padding to 8 for 5-7) over every linear of one step."""
    from brisk.models.linear import _matmul

    loaded = load(warmup=False)
    arrays = [m.weight.numpy() for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    print("| rows | sgemm ms | brisk path ms | speedup |")
    print("|---|---|---|---|")
    for m in range(1, 17):
        xs = {k: np.random.randn(m, k).astype(np.float32) for k in {a.shape[1] for a in arrays}}
        t_gemm = bench(lambda: [np.matmul(xs[a.shape[1]], a.T) for a in arrays])
        t_ours = bench(lambda: [_matmul(xs[a.shape[1]], a.T) for a in arrays])
        print(f"| {m} | {t_gemm * 1e3:.1f} | {t_ours * 1e3:.1f} | {t_gemm / t_ours:.2f}x |", flush=True)


if __name__ == "__main__":
    import sys

    small_rows() if "--small-rows" in sys.argv else main()
