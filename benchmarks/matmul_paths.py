"""Per-shape matmul paths for the demo model's linears: torch `F.linear`, numpy (OpenBLAS),
and oneDNN with weights packed once (`brisk.models.linear`'s path).

For each number of rows M, runs every linear of one decoder step (all layers + lm_head)
and reports ms per path and the best path's GB/s (M=1) or GFLOP/s. Used to choose
`brisk.models.linear`'s backend.

    .venv/bin/python benchmarks/matmul_paths.py [--rows 1,2,4,8,16,32,64,128,256,512,1024]
"""

import argparse
import time

import torch
import torch.nn.functional as F

from brisk.loading.loader import load
from brisk.models.linear import PACK_ROWS_HINT


def bench(fn, runs=5):
    fn()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,1024")
    args = parser.parse_args()
    loaded = load(warmup=False)
    weights = [m.weight.detach() for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    arrays_t = [w.numpy().T for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    print(f"{len(weights)} linears, {nbytes / 1e6:.0f} MB of fp32 weights, torch threads {torch.get_num_threads()}")
    print("| rows | F.linear ms | numpy ms | oneDNN packed ms | packed vs numpy | packed rate |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
            t_torch = bench(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights])
            t_numpy = bench(lambda xs=xs: [xs[a.shape[0]].numpy() @ a for a in arrays_t])
            t_packed = bench(lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                            for w, p in zip(weights, packed)])
            rate = f"{nbytes / t_packed / 1e9:.0f} GB/s" if m == 1 else f"{2 * m * nbytes / 4 / t_packed / 1e9:.0f} GFLOP/s"
            print(f"| {m} | {t_torch * 1e3:.1f} | {t_numpy * 1e3:.1f} | {t_packed * 1e3:.1f} "
                  f"| {t_numpy / t_packed:.2f}x | {rate} |", flush=True)


if __name__ == "__main__":
    main()
