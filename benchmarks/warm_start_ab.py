"""Warm start of `brisk serve` from two source trees, started alternately (A, B, A, B, ...), so a change to
the load path is compared on the same host at the same moments (these machines drift by 2x within a day).

For each start: seconds to `/ready` answering 200, to the first answered 1-token chat completion, and the
load report's `first_forward` phase. The first start of each tree only warms the page cache; the medians
are over the rest.

    .venv/bin/python benchmarks/warm_start_ab.py --gguf MODEL.gguf --a TREE_BEFORE --b TREE_AFTER [--starts 4]

Each tree is a checkout (e.g. `git worktree add`) with its kernels built; `python -m brisk` runs from it.
"""

from __future__ import annotations

import argparse
import os
import re
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
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    serve_args = argparse.Namespace(concurrency="1", long_prompt=0, llama_server=None, work=args.work)
    print(f"machine read bandwidth: {read_bandwidth_gbs()[0]:.1f} GB/s", flush=True)
    results: dict[str, list[tuple[float, float, float]]] = {"A": [], "B": []}
    for i in range(args.starts):
        for label, tree in (("A", args.a), ("B", args.b)):
            os.chdir(tree)  # `python -m brisk` imports the package of the working directory
            log = args.work / f"warm-start-{label}-{i}.log"
            proc, _, (ready, answer) = qp.start("brisk", args.gguf, serve_args, log)
            qp.stop(proc)
            phase = re.search(r"first_forward\s+([\d.]+) ms", log.read_text())
            first_forward = float(phase.group(1)) / 1e3 if phase else float("nan")
            results[label].append((ready, answer, first_forward))
            print(f"{label} start {i}: ready {ready:.2f} s, first answer {answer:.2f} s, "
                  f"first_forward {first_forward:.2f} s", flush=True)
    print("| tree | ready | first answer | first_forward |")
    print("|---|---|---|---|")
    for label, rows in results.items():
        rows = rows[1:] or rows
        medians = [sorted(r[k] for r in rows)[len(rows) // 2] for k in range(3)]
        print(f"| {label} | {medians[0]:.2f} s | {medians[1]:.2f} s | {medians[2]:.2f} s |")


if __name__ == "__main__":
    main()
