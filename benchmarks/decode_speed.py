"""Single-stream decode speed with achieved weight bandwidth.

Generates 128 tokens (greedy, EOS ignored) after a short chat prompt, and reports
tok/s, the GB/s of weights streamed per token, and that as a fraction of this
machine's read bandwidth, measured here by a plain C read loop on all cores
(compiled with the system gcc; numpy's sum as a fallback).

    .venv/bin/python benchmarks/decode_speed.py [--tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np

C_READ_LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
int main(void) {
    size_t n = (size_t)1 << 28;  /* 1 GiB of floats */
    float *a = malloc(n * sizeof(float));
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) a[i] = (float)(i & 7);
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t = omp_get_wtime();
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
        #pragma omp parallel for reduction(+:s0,s1,s2,s3,s4,s5,s6,s7)
        for (size_t i = 0; i < n; i += 8) {
            s0 += a[i]; s1 += a[i+1]; s2 += a[i+2]; s3 += a[i+3];
            s4 += a[i+4]; s5 += a[i+5]; s6 += a[i+6]; s7 += a[i+7];
        }
        double gbs = n * sizeof(float) / (omp_get_wtime() - t) / 1e9;
        if (gbs > best) best = gbs;
        if (s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7 < 0) puts("");
    }
    printf("%f\n", best);
    return 0;
}
"""


def read_bandwidth_gbs() -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "bw.c"), os.path.join(tmp, "bw")
        with open(src, "w") as f:
            f.write(C_READ_LOOP)
        try:
            subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", src, "-o", exe], check=True,
                           capture_output=True)
            return float(subprocess.run([exe], check=True, capture_output=True, text=True).stdout), "C read loop"
        except (OSError, subprocess.CalledProcessError):
            a = np.ones(1 << 28, dtype=np.float32)
            t = time.perf_counter()
            a.sum()
            return a.nbytes / (time.perf_counter() - t) / 1e9, "numpy sum (1 thread)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from brisk.generate import GenerationTimings, generate_ids
    from brisk.loading.loader import load

    loaded = load()
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "Tell me a long story about a dragon."}])
    rates = []
    for _ in range(args.runs):
        timings = GenerationTimings()
        out = list(generate_ids(loaded, ids, args.tokens, ignore_eos=True, timings=timings))
        rates.append((len(out) - 1) / (timings.decode_ms / 1e3))
    tok_s = statistics.median(rates)
    weight_gb = loaded.report.weight_bytes / 1e9
    bandwidth, how = read_bandwidth_gbs()
    print(f"| model | weights | decode tok/s (median of {args.runs}, {args.tokens} tokens) | weight GB/s | "
          f"machine read GB/s ({how}) | fraction |")
    print("|---|---|---|---|---|---|")
    print(f"| {loaded.name} {loaded.report.dtype} on {loaded.report.device} | {weight_gb * 1e3:.0f} MB | "
          f"{tok_s:.1f} | {tok_s * weight_gb:.1f} | {bandwidth:.1f} | {tok_s * weight_gb / bandwidth:.0%} |")


if __name__ == "__main__":
    main()
