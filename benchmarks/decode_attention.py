"""Decode attention for one layer at long contexts: --rows rows of ~--context tokens each (ragged),
block tables scattered over the pool as the KV manager hands them out. Compares, in one run:

  kernel   brisk/kernels/paged_attention.cpp, reading K/V in place through the block tables, on
           each SIMD path the CPU has (AVX2; AVX-512 where present: what serving picks)
  torch    the reference path: index_select the context out of the cache, SDPA on the copy
  bound    the time to read the rows' K/V bytes once at the machine's measured read bandwidth

    .venv/bin/python benchmarks/decode_attention.py [--rows 64] [--context 2000] [--dtype float32]

The default shape is the demo model's (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_speed import read_bandwidth_gbs  # noqa: E402

from brisk import kernels  # noqa: E402
from brisk.engine.attention import AttentionMetadata, PagedKVCache, TorchPagedAttention, block_tables  # noqa: E402


def timed(fns: dict, repeat: int) -> dict[str, list[float]]:
    """Runs the candidates interleaved (one of each per round), so that a noisy neighbour on this
    shared machine slows them alike; returns each one's times."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--hugepages", action="store_true",
                        help="also time the served kernel on a cache without huge pages (4 KB pages), same run")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    bs = args.block_size
    lengths = [max(1, args.context - 7 * r) for r in range(args.rows)]  # ragged, as real batches are
    per_row = [-(-n // bs) for n in lengths]
    num_blocks = sum(per_row) + 1
    pool = list(range(1, num_blocks))
    random.Random(0).shuffle(pool)
    tables, used = [], 0
    for nb in per_row:
        tables.append(pool[used:used + nb])
        used += nb
    cache = PagedKVCache(1, num_blocks * bs, args.kv_heads, args.head_dim, dtype, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    small = None
    if args.hugepages:
        small = PagedKVCache(1, num_blocks * bs, args.kv_heads, args.head_dim, dtype, torch.device("cpu"),
                             huge_pages=False)
        small.k.copy_(cache.k)
        small.v.copy_(cache.v)
    q = torch.randn(args.rows, args.heads, args.head_dim, dtype=dtype)
    table_t = block_tables(tables, lengths, bs)
    lens = torch.tensor(lengths, dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), bs, table_t, lens, [])
    scale = args.head_dim ** -0.5
    torch_path = TorchPagedAttention(cache, meta, scale)
    torch_path._gathered_decode(q, cache.k[0], cache.v[0], None)  # expands the slots once, as a step does

    kv_bytes = sum(lengths) * args.kv_heads * args.head_dim * cache.k.element_size() * 2
    before, how = read_bandwidth_gbs()
    lib = kernels.library()

    def kernel(isa: int):
        def run():
            lib.brisk_paged_attention_force_isa(isa)
            kernels.paged_decode_attention(q, cache.k[0], cache.v[0], table_t, lens, bs, scale)
        return run

    # every SIMD path this CPU runs (the best one is what serving uses), and the torch path
    best_isa = lib.brisk_paged_attention_isa()
    paths = {f"kernel {name}": kernel(isa) for isa, name in ((2, "avx2"), (3, "avx512")) if isa <= best_isa}
    if small is not None:
        def four_kb_pages():
            lib.brisk_paged_attention_force_isa(-1)  # the path serving picks
            kernels.paged_decode_attention(q, small.k[0], small.v[0], table_t, lens, bs, scale)
        paths["kernel, 4 KB pages"] = four_kb_pages
    paths["torch (gather+SDPA)"] = lambda: torch_path._gathered_decode(q, cache.k[0], cache.v[0], None)
    times = timed(paths, args.repeat)
    lib.brisk_paged_attention_force_isa(-1)
    # this shared machine's bandwidth moves within minutes (34-63 GB/s in one hour): probed before
    # and after the timings, and the bound taken from their mean
    after, _ = read_bandwidth_gbs()
    bandwidth = (before + after) / 2
    bound = kv_bytes / (bandwidth * 1e9)
    print(f"{args.rows} rows x ~{args.context} tokens ({sum(lengths)} in all), heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, {args.dtype} KV, block size {bs}; threads {torch.get_num_threads()}, "
          f"kernel ISA {kernels.attention_isa()}")
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}; {before:.1f} before the timings, {after:.1f} after); "
          f"K/V bytes per layer {kv_bytes / 2**20:.1f} MiB -> read-once bound {bound * 1e3:.2f} ms")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name:20s} median {medians[name] * 1e3:8.2f} ms per layer ({medians[name] / bound:5.2f}x the bound), "
              f"best {min(t) * 1e3:8.2f} ms ({min(t) / bound:5.2f}x)")
    served = f"kernel {kernels.attention_isa()}"
    print(f"  {served} speed-up over torch: {medians['torch (gather+SDPA)'] / medians[served]:.2f}x (medians)")


if __name__ == "__main__":
    main()
