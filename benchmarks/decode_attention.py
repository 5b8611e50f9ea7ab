"""Decode attention for one layer at long contexts: --rows rows of ~--context tokens each (ragged),
block tables scattered over the pool as the KV manager hands them out. Compares, in one run:

  kernel   brisk/kernels/paged_attention.cpp, reading K/V in place through the block tables, on
           each SIMD path the CPU has (AVX2; AVX-512 where present: what serving picks; on AVX512-FP16
           CPUs, where fp8 multiplies in float16, fp8 also on the float32 AVX-512 loop)
  torch    the reference path: index_select the context out of the cache, SDPA on the copy
  bound    the time to read the rows' K/V bytes once at the machine's measured read bandwidth
           (per KV dtype: its own bytes, int8's scales included)
  bare read  a C loop (compiled here with the system gcc) that only reads the lines the kernel reads,
           in its order (rows in parts of 512 positions, chunks of 32 positions for the 1-byte types and
           16 for the wider ones, the next chunk prefetched): what the layout alone costs, no arithmetic
           (decode rows only)

for each KV cache dtype (--kv-dtype, default all of them; the kernel reads each in place).

    .venv/bin/python benchmarks/decode_attention.py [--rows 64] [--context 2000] [--kv-dtype float32 int8]
        [--baseline-lib OTHER/brisk/kernels/_kernels.so]   (a kernel change against the build before it:
            per dtype, the two builds alternate in rounds of their own after the table's; the baseline
            row's median is from those rounds, its "this" ratio from the two builds' medians there)
        [--contiguous]   (each row's blocks in order, as a fresh pool hands a prompt's out)

With --contiguous --rows 16 --context 500 a layer's cache fits the L3 cache of most servers: the
kernel's arithmetic, nearly without the memory's stalls (OMP_NUM_THREADS=1: one core's).

The default shape is the demo model's (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_speed import read_bandwidth_gbs  # noqa: E402

from brisk import kernels  # noqa: E402
from brisk.engine.attention import AttentionMetadata, PagedKVCache, TorchPagedAttention, block_tables  # noqa: E402
from brisk.kv_dtype import DTYPES  # noqa: E402


def timed(fns: dict, repeat: int) -> dict[str, list[float]]:
    """Runs the candidates interleaved (one of each per round), so that a noisy neighbour on this
    shared machine slows them alike, each round starting one candidate later (in a fixed order the
    first one read ~5% slow against an identical build); returns each one's times."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for fn in fns.values():
        fn()  # warm-up
    for round_ in range(repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return times


C_BARE_READ = r"""
#include <stdint.h>
#include <omp.h>
/* Reads every 64-byte line of each row's K and V slots (and int8's scales) the way the paged kernel
   walks them: items of part_tokens positions handed out dynamically, chunks of `span` positions
   across blocks, the next chunk's lines prefetched before this one's are read. */
static void lines(const char* p, int64_t bytes, uint64_t* sum) {
    for (int64_t b = 0; b < bytes; b += 64) *sum += *(const volatile uint64_t*)(p + b);
}
static void fetch(const char* p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}
uint64_t bare_read(const char* k, const char* v, const char* ks, const char* vs, int64_t scale_bytes,
                   const int32_t* tables, int64_t max_blocks, const int32_t* lens, int64_t rows,
                   int64_t block_size, int64_t row_bytes, int64_t span, int64_t part_tokens) {
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; r++) longest = lens[r] > longest ? lens[r] : longest;
    const int64_t parts = (longest + part_tokens - 1) / part_tokens;
    if (span < block_size) span = block_size < 32 ? block_size : 32;  /* a block's, at most 32, as the kernel */
    uint64_t total = 0;
    #pragma omp parallel for schedule(dynamic, 1) reduction(+ : total)
    for (int64_t i = 0; i < rows * parts; i++) {
        const int64_t r = i / parts, start = (i % parts) * part_tokens;
        const int64_t end = start + part_tokens < lens[r] ? start + part_tokens : lens[r];
        const int32_t* table = tables + r * max_blocks;
        uint64_t sum = 0;
        for (int64_t pos = start; pos < end; pos += span) {
            for (int pass = 0; pass < 2; pass++) {  /* 0: prefetch the next chunk; 1: read this one */
                const int64_t from = pass ? pos : pos + span, to = from + span < end ? from + span : end;
                for (int64_t t = from; t < to; t++) {
                    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                    if (pass) {
                        lines(k + slot * row_bytes, row_bytes, &sum);
                        lines(v + slot * row_bytes, row_bytes, &sum);
                    } else {
                        fetch(k + slot * row_bytes, row_bytes);
                        fetch(v + slot * row_bytes, row_bytes);
                    }
                    if (pass && ks) {  /* int8: the slot's scales */
                        sum += *(const volatile uint32_t*)(ks + slot * scale_bytes);
                        sum += *(const volatile uint32_t*)(vs + slot * scale_bytes);
                    }
                }
            }
        }
        total += sum;
    }
    return total;
}
"""


def bare_reader():
    """The C loop above, compiled with the system gcc into a temporary library; None without gcc."""
    import ctypes
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:  # (the loaded library outlives its file)
        src, lib = os.path.join(tmp, "bare_read.c"), os.path.join(tmp, "bare_read.so")
        with open(src, "w") as f:
            f.write(C_BARE_READ)
        try:
            subprocess.run(["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", src, "-o", lib], check=True,
                           capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        fn = ctypes.CDLL(lib).bare_read
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + \
        [ctypes.c_int64] * 5
    return fn


def filled_cache(args, num_slots: int, kv, huge_pages: bool = True) -> PagedKVCache:
    """A one-layer pool of random K/V, written through the store each dtype serves with."""
    cache = PagedKVCache(1, num_slots, args.kv_heads, args.head_dim, kv, torch.device("cpu"), huge_pages=huge_pages)
    gen = torch.Generator().manual_seed(0)
    step = 4096
    for start in range(0, num_slots, step):
        slots = torch.arange(start, min(num_slots, start + step))
        k, v = torch.randn(2, len(slots), args.kv_heads, args.head_dim, generator=gen)
        cache.store(0, k, v, slots)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=0,
                        help="rows are prompt chunks of this many consecutive positions (the kernel's tiles), "
                             "--rows / --chunk sequences; 0: one decode row per sequence")
    parser.add_argument("--staging", action="store_true",
                        help="also time each dtype with every run read in place and with every run staged "
                             "(the default stages a prompt chunk's tiles and reads a lone row in place)")
    parser.add_argument("--baseline-lib", metavar="SO",
                        help="also time each dtype on another build of brisk's kernels (e.g. the commit before a "
                             "change, `make` in a worktree: its brisk/kernels/_kernels.so), alternating with this "
                             "build in rounds of their own, on that dtype's data")
    parser.add_argument("--contiguous", action="store_true",
                        help="each row's blocks in order in the pool (the default scatters them, as a pool in use does)")
    parser.add_argument("--hugepages", action="store_true",
                        help="also time the served kernel on a cache without huge pages (4 KB pages), same run")
    args = parser.parse_args()
    bs = args.block_size
    if args.chunk:  # prompt chunks laid out as decode rows: `chunk` consecutive positions per sequence
        seqs = [max(args.chunk, args.context - 7 * s) for s in range(max(1, args.rows // args.chunk))]
    else:
        seqs = [max(1, args.context - 7 * r) for r in range(args.rows)]  # ragged, as real batches are
    per_seq = [-(-n // bs) for n in seqs]
    num_blocks = sum(per_seq) + 1
    pool = list(range(1, num_blocks))
    if not args.contiguous:
        random.Random(0).shuffle(pool)
    tables, lengths, used = [], [], 0
    for n, nb in zip(seqs, per_seq):
        rows = range(n - args.chunk + 1, n + 1) if args.chunk else [n]
        tables += [pool[used:used + nb]] * len(rows)
        lengths += list(rows)
        used += nb
    args.rows = len(lengths)
    caches = {name: filled_cache(args, num_blocks * bs, DTYPES[name]) for name in args.kv_dtype}
    first = args.kv_dtype[0]
    q = torch.randn(args.rows, args.heads, args.head_dim)
    table_t = block_tables(tables, lengths, bs)
    lens = torch.tensor(lengths, dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), bs, table_t, lens, [])
    scale = args.head_dim ** -0.5
    torch_path = TorchPagedAttention(caches[first], meta, scale)
    torch_path._gathered_decode(q, 0, None)  # expands the slots once, as a step does

    def kv_bytes(name: str) -> int:  # a tile of 8 consecutive rows reads its context once
        tokens = sum(lengths) // 8 if args.chunk else sum(lengths)
        return tokens * args.kv_heads * DTYPES[name].row_bytes(args.head_dim) * 2

    before, how = read_bandwidth_gbs()
    lib = kernels.library()

    def kernel(cache: PagedKVCache, isa: int, mode: int | None = None, build=None):
        def run():
            use = build or lib
            use.brisk_paged_attention_force_isa(isa)
            use.brisk_paged_attention_staged(default_mode if mode is None else mode)
            kernels._lib = use  # the build paged_decode_attention calls (this process's, or the baseline)
            try:
                return kernels.paged_decode_attention(q, cache.k[0], cache.v[0], table_t, lens, bs, scale,
                                                      kv_dtype=cache.dtype, scales=cache.scales(0))
            finally:
                kernels._lib = lib
        return run

    # every dtype on the path serving picks; the first dtype also on AVX2 (where AVX-512 is the best),
    # without huge pages (--hugepages), and through the torch path
    best_isa = lib.brisk_paged_attention_isa()
    served = kernels.attention_isa()
    default_mode = lib.brisk_paged_attention_staged(-1)  # (only read)
    paths = {(name, f"kernel {served}"): kernel(cache, -1) for name, cache in caches.items()}
    if args.staging:  # each dtype also with every run in place, and with every run staged
        for name, cache in caches.items():
            paths[(name, f"kernel {served} in place")] = kernel(cache, -1, 0)
            paths[(name, f"kernel {served} staged")] = kernel(cache, -1, 2)
    bits = []  # printed after the table, where a `tail` of the output keeps them
    pairs = {}  # --baseline-lib: per dtype, this build and the baseline, timed apart (below)
    if args.baseline_lib:
        baseline = kernels._bind(Path(args.baseline_lib))
        for name, cache in caches.items():
            this, other = paths[(name, f"kernel {served}")], kernel(cache, -1, build=baseline)
            pairs[name] = {"this": this, "baseline": other}
            same = torch.equal(this(), other())
            bits.append(f"{name}: this build's output {'equals' if same else 'DIFFERS FROM'} the baseline's, bit for bit")
    if best_isa > 3:  # the float32 arithmetic fp8 takes on AVX-512 CPUs without AVX512-FP16 (int8: the same loop)
        for name in (n for n in caches if DTYPES[n].element_bytes == 1 and not DTYPES[n].scaled):
            paths[(name, "kernel avx512")] = kernel(caches[name], 3)
    if best_isa > 2:
        paths[(first, "kernel avx2")] = kernel(caches[first], 2)
    if args.hugepages:
        small = filled_cache(args, num_blocks * bs, DTYPES[first], huge_pages=False)
        paths[(first, f"kernel {served} 4 KB pages")] = kernel(small, -1)
    paths[(first, "torch (gather+SDPA)")] = lambda: torch_path._gathered_decode(q, 0, None)
    reader = None if args.chunk else bare_reader()
    if reader is not None:  # the layout's own cost: the kernel's reads, in its order, no arithmetic
        def bare(cache: PagedKVCache):
            kv = cache.dtype
            ks, vs = cache.scales(0)
            row_bytes = args.kv_heads * args.head_dim * cache.k.element_size()
            return lambda: reader(cache.k[0].data_ptr(), cache.v[0].data_ptr(),
                                  ks.data_ptr() if ks is not None else None, vs.data_ptr() if vs is not None else None,
                                  args.kv_heads * 4, table_t.data_ptr(), table_t.shape[1], lens.data_ptr(),
                                  args.rows, bs, row_bytes, 32 if kv.element_bytes == 1 else 16,
                                  kernels.PART_TOKENS)
        for name, cache in caches.items():
            paths[(name, "bare read (no arithmetic)")] = bare(cache)
    times = timed(paths, args.repeat)
    # Each dtype's two builds alternate in rounds of their own, after the table's rounds. Among every
    # other path a call's time depends on the calls before it: on a 2-core AVX-512 host two
    # byte-identical builds read 0.85-0.94x of each other there, and 1.00-1.02x in rounds of their own.
    versus = {}
    for name, pair in pairs.items():
        pair_times = timed(pair, args.repeat)
        times[(name, f"baseline {served}")] = pair_times["baseline"]
        versus[name] = statistics.median(pair_times["baseline"]) / statistics.median(pair_times["this"])
    lib.brisk_paged_attention_force_isa(-1)
    lib.brisk_paged_attention_staged(default_mode)
    # this shared machine's bandwidth moves within minutes (34-63 GB/s in one hour): probed before
    # and after the timings, and the bound taken from their mean
    after, _ = read_bandwidth_gbs()
    bandwidth = (before + after) / 2
    print(f"{args.rows} rows x ~{args.context} tokens ({sum(lengths)} in all), heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, block size {bs} ({'in order' if args.contiguous else 'scattered'}); "
          f"threads {os.environ.get('OMP_NUM_THREADS') or torch.get_num_threads()}, kernel ISA {served}")
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}; {before:.1f} before the timings, {after:.1f} after)")
    medians = {key: statistics.median(t) for key, t in times.items()}
    print(f"  {'KV dtype':9s} {'path':26s} {'MiB/layer':>9s} {'bound ms':>9s} {'median ms':>10s} {'x bound':>8s} "
          f"{'best ms':>8s} {'vs float32':>10s}")
    base = medians.get(("float32", f"kernel {served}"))
    for (name, path), t in times.items():
        bound = kv_bytes(name) / (bandwidth * 1e9)
        speed = f"{base / medians[(name, path)]:.2f}x" if base and path == f"kernel {served}" else ""
        if path.startswith("baseline"):  # this build's speed-up over the baseline, from their own rounds
            speed = f"this {versus[name]:.2f}x"
        # (a baseline's rounds repeat one dtype's data, which a large L3 may then hold: no bound for them)
        x_bound = "-" if path.startswith("baseline") else f"{medians[(name, path)] / bound:.2f}x"
        print(f"  {name:9s} {path:26s} {kv_bytes(name) / 2**20:9.1f} {bound * 1e3:9.2f} {medians[(name, path)] * 1e3:10.2f} "
              f"{x_bound:>8s} {min(t) * 1e3:8.2f} {speed:>10s}")
    for line in bits:
        print(line)


if __name__ == "__main__":
    main()
