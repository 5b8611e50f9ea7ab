"""Per-shape matmul paths for one decoder step's linears: torch `F.linear`, numpy (OpenBLAS),
oneDNN with float32 weights packed once (`brisk.models.linear`), and brisk's quantized kernels
(`brisk.kernels`: int4 and int8 blocks of 32, int8 activation blocks; int4 and int8 in the row
layout and in the tiled layouts brisk's conversion stores linears in), plus the quantized
weights dequantized to float32 per call and run through `F.linear` (the alternative for large
row counts).

For each number of rows M, runs every linear of one decoder step (all layers + lm_head)
and reports ms per path. Used to choose `brisk.models.linear`'s backend and
`brisk.models.quant.QuantLinear`'s row threshold.

    .venv/bin/python benchmarks/matmul_paths.py [--model PATH] [--rows 1,2,4,8,16,32,64,128,256,512]
"""

import argparse
import time

import torch
import torch.nn.functional as F

from brisk import kernels
from brisk.loading.loader import load
from brisk.models.linear import PACK_ROWS_HINT
from brisk.models.quant import quantize_int4, quantize_int8, tile


def bench(fn, runs=5):
    fn()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF or HF dir (default: the demo model)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    args = parser.parse_args()
    loaded = load(args.model, quantization="none", warmup=False)
    weights = [m.weight.detach() for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    arrays_t = [w.numpy().T for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights]
    int4 = [quantize_int4(w) for w in weights]
    int8 = [quantize_int8(w) for w in weights]
    int4_tiled = [tile(q) if q["qweight"].shape[0] % kernels.TILE_ROWS == 0 else q for q in int4]
    int8_tiled = [tile(q) if q["qweight"].shape[0] % kernels.TILE_ROWS == 0 else q for q in int8]
    nbytes = sum(w.numel() * 4 for w in weights)
    print(f"{len(weights)} linears, {nbytes / 1e6:.0f} MB of fp32 weights "
          f"({sum(q['qweight'].numel() for q in int4) / 1e6 * 1.25:.0f} MB as int4), torch threads "
          f"{torch.get_num_threads()}, kernels {kernels.isa()}")
    print("| rows | F.linear ms | numpy ms | oneDNN packed fp32 ms | int8 kernel ms | int8 tiled kernel ms "
          "| int4 kernel ms | int4 tiled kernel ms | int4 dequantized + F.linear ms |")
    print("|---|---|---|---|---|---|---|---|---|")

    def quant(xs, blocks, bits):
        return [kernels.quant_matmul(xs[w.shape[1]], q["qweight"], q["scales"], q.get("mins"), bits)
                for w, q in zip(weights, blocks)]

    def dequant_linear(xs):
        return [F.linear(xs[w.shape[1]], kernels.dequantize(q["qweight"], q["scales"], q["mins"], 4))
                for w, q in zip(weights, int4)]

    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
            runs = 2 if m >= 128 else 5
            cells = [bench(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], runs),
                     bench(lambda xs=xs: [xs[a.shape[0]].numpy() @ a for a in arrays_t], runs),
                     bench(lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                          for w, p in zip(weights, packed)], runs),
                     bench(lambda xs=xs: quant(xs, int8, 8), runs),
                     bench(lambda xs=xs: quant(xs, int8_tiled, 8), runs),
                     bench(lambda xs=xs: quant(xs, int4, 4), runs),
                     bench(lambda xs=xs: quant(xs, int4_tiled, 4), runs),
                     bench(lambda xs=xs: dequant_linear(xs), runs)]
            print(f"| {m} | " + " | ".join(f"{t * 1e3:.1f}" for t in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
