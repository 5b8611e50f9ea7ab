"""brisk's quantized matmul kernel per GGUF weight type kept as stored, one matrix, same process.

For each type, a random float32 matrix (default 14336 x 4096: a Mistral-7B FFN matrix) is quantized to
the type's GGUF blocks (`gguf.quants.quantize` for Q4_0/Q8_0, `brisk.loading.gguf_random`'s quantizers
for the K-quants and IQ4), repacked and tiled as brisk's conversion does, and multiplied by M activation
rows with `brisk.kernels.quant_matmul` (the kernels' best path on this CPU, all threads). Reports the
median ms per call, the weight bytes read per call, GB/s at 1 row (what bounds decode) and GFLOP/s at
more rows (what bounds prefill), beside the machine's read-bandwidth probe.

With `--baseline-lib OTHER.so` (a build of the kernels before a change) each cell is also timed with that
build, alternating call by call, and its output compared bit for bit: the cell then reads "this / baseline".

    .venv/bin/python benchmarks/gguf_type_kernels.py [--types Q4_0,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS]
        [--rows 1,16,64] [--shape 14336x4096] [--calls 20] [--baseline-lib SO]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_speed import read_bandwidth_gbs  # noqa: E402

from brisk import kernels  # noqa: E402
from brisk.loading import gguf_convert, gguf_random  # noqa: E402
from brisk.models.quant import CODEBOOK, QuantFormat, tile  # noqa: E402

QUANTIZERS = {"Q2_K": gguf_random.quantize_q2_k, "Q3_K": gguf_random.quantize_q3_k,
              "Q4_K": gguf_random.quantize_q4_k, "Q5_K": gguf_random.quantize_q5_k,
              "Q6_K": gguf_random.quantize_q6_k, "IQ4_NL": gguf_random.quantize_iq4_nl,
              "IQ4_XS": gguf_random.quantize_iq4_xs}


def stored(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], QuantFormat]:
    """The tiled tensors brisk's conversion stores for a random [rows, cols] matrix of `qtype`, and their format."""
    import gguf

    values = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * 0.02
    if qtype in QUANTIZERS:
        raw = QUANTIZERS[qtype](values)
        arrays = gguf_convert._SUPER_REPACKS[qtype](raw, rows, cols)
    else:
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
        arrays = gguf_convert._repack_legacy(raw, rows, cols, qtype)
    fmt = gguf_convert.NATIVE_FORMATS[qtype]
    blocks = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    if fmt.codebook:
        blocks[CODEBOOK] = torch.tensor(kernels.IQ4_VALUES, dtype=torch.int8)
    tiled = tile(blocks, fmt.bits)
    return tiled, QuantFormat.of({f"w.{k}": v for k, v in tiled.items()}, "w")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_0,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--shape", default="14336x4096")
    parser.add_argument("--calls", type=int, default=20, help="timed calls at 1 row (fewer at more rows)")
    parser.add_argument("--baseline-lib", metavar="SO", type=Path, default=None,
                        help="another build of the kernels, timed in the same loop")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    this = kernels.library()
    if this is None:
        print("brisk: the compiled kernels are missing: run `make`", file=sys.stderr)
        return 1
    builds = {"this": this}
    if args.baseline_lib:
        builds["baseline"] = kernels._bind(args.baseline_lib)
    gbs, how = read_bandwidth_gbs()
    print(f"kernels: {kernels.isa()}, {torch.get_num_threads()} threads; read bandwidth probe {gbs:.1f} GB/s ({how})")
    print(f"\n| type (brisk format) | bits a weight | MB | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|---|---|" + "---|" * len(rows))
    for qtype in args.types.split(","):
        tensors, fmt = stored(qtype, n, k)
        weight_bytes = sum(t.numel() * t.element_size() for name, t in tensors.items() if name != CODEBOOK)
        cells = []
        for m in rows:
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {name: [] for name in builds}
            outputs = {}
            for repeat in range(1 + max(3, args.calls // max(1, m // 4))):
                for name, lib in builds.items():
                    kernels._lib = lib  # the build quant_matmul calls
                    start = time.perf_counter()
                    out = kernels.quant_matmul(x, tensors["qweight"], tensors["scales"], tensors.get("mins"),
                                               fmt.kernel_bits, tensors.get("subscales"))
                    if repeat:  # the first call of each build warms up
                        times[name].append(time.perf_counter() - start)
                    outputs[name] = out
            kernels._lib = this
            ms = statistics.median(times["this"]) * 1e3
            rate = f"{weight_bytes / ms / 1e6:.1f} GB/s" if m == 1 else f"{2 * m * n * k / ms / 1e6:.0f} GFLOP/s"
            cell = f"{ms:.2f} ms ({rate})"
            if "baseline" in builds:
                same = torch.equal(outputs["this"], outputs["baseline"])
                cell += f" / {statistics.median(times['baseline']) * 1e3:.2f} ms{'' if same else ' (OUTPUT DIFFERS)'}"
            cells.append(cell)
        print(f"| {qtype} ({fmt.name}) | {fmt.bits_per_weight:.4g} | {weight_bytes / 1e6:.1f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
