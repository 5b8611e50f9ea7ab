"""Warm (or, with --cold, first) start of `brisk serve` from two source trees, started alternately (A, B, A, B,
...), so a change to the load path is compared on the same host at the same moments (these machines drift by 2x
within a day).

For each start: seconds to `/ready` answering 200, to the first answered 1-token chat completion, and the
load report's `first_forward` phase (with --cold, the conversion: `dequantize_write` when it is written before
serving, `convert_in_memory` when it is served from memory). The first start of
each tree only warms the page cache; the medians are over the rest.
--cold gives every start an empty cache directory (BRISK_CACHE), so each one converts the GGUF as a user's
first start does; --llama-server PATH starts that peer on the same file after each pair (to /health).

    .venv/bin/python benchmarks/warm_start_ab.py --gguf MODEL.gguf --a TREE_BEFORE --b TREE_AFTER [--starts 4]
        [--cold] [--llama-server PATH]

Each tree is a checkout (e.g. `git worktree add`) with its kernels built; `python -m brisk` runs from it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

import quantized_peers as qp  # noqa: E402
from decode_speed import read_bandwidth_gbs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--a", type=Path, required=True, help="source tree A (before)")
    parser.add_argument("--b", type=Path, required=True, help="source tree B (after)")
    parser.add_argument("--starts", type=int, default=4)
    parser.add_argument("--work", type=Path, default=HERE / "peers" / ".work")
    parser.add_argument("--cold", action="store_true", help="an empty conversion cache for every start")
    parser.add_argument("--llama-server", default=None, help="also start this llama-server after each pair")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    serve_args = argparse.Namespace(concurrency="1", long_prompt=0, llama_server=args.llama_server, work=args.work,
                                    brisk_kv_memory=None)
    print(f"machine read bandwidth: {read_bandwidth_gbs()[0]:.1f} GB/s", flush=True)
    # a cold start's conversion: written first (`dequantize_write`) or built in memory (`convert_in_memory`)
    phase_name = "dequantize_write|convert_in_memory" if args.cold else "first_forward"
    kind = "cold" if args.cold else "warm"
    trees = [("A", args.a), ("B", args.b)] + ([("llama-server", None)] if args.llama_server else [])
    results: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _ in trees}
    cache = args.work / "cold-start-cache"
    for i in range(args.starts):
        for label, tree in trees:
            log = args.work / f"{kind}-start-{label}-{i}.log"
            if tree is None:
                proc, _, (ready, answer) = qp.start("llama-server", args.gguf, serve_args, log)
                qp.stop(proc)
                results[label].append((ready, answer, float("nan")))
                print(f"{label} start {i}: ready {ready:.2f} s, first answer {answer:.2f} s", flush=True)
                continue
            os.chdir(tree)  # `python -m brisk` imports the package of the working directory
            if args.cold:
                shutil.rmtree(cache, ignore_errors=True)
                os.environ["BRISK_CACHE"] = str(cache)
            proc, _, (ready, answer) = qp.start("brisk", args.gguf, serve_args, log)
            qp.stop(proc)
            phase = re.search(f"(?:{phase_name})" + r"\s+([\d.]+) ms", log.read_text())
            seconds = float(phase.group(1)) / 1e3 if phase else float("nan")
            results[label].append((ready, answer, seconds))
            print(f"{label} start {i}: ready {ready:.2f} s, first answer {answer:.2f} s, "
                  f"{'conversion' if args.cold else phase_name} {seconds:.2f} s", flush=True)
    if args.cold:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"| {kind} start | ready | first answer | {phase_name.replace('|', ' or ')} |")
    print("|---|---|---|---|")
    for label, rows in results.items():
        rows = rows[1:] or rows
        medians = [sorted(r[k] for r in rows)[len(rows) // 2] for k in range(3)]
        print(f"| {label} | {medians[0]:.2f} s | {medians[1]:.2f} s | {medians[2]:.2f} s |")


if __name__ == "__main__":
    main()
