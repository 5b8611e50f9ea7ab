"""Host-side preparation of one decode step (ModelRunner._prepare: token ids, positions, slot
mapping and the attention metadata) at long contexts: --rows decode rows of --context tokens
each, with block tables as the KV manager would hand them out (scattered blocks).

    .venv/bin/python benchmarks/step_prepare.py [--rows 64] [--context 2000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from brisk.engine.model_runner import ModelRunner
from brisk.engine.request import Request
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import ScheduledChunk
from brisk.loading.loader import load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    loaded = load()
    bs = args.block_size
    blocks_per_row = -(-(args.context + 1) // bs)
    num_blocks = args.rows * blocks_per_row + 1
    runner = ModelRunner(loaded, num_blocks, bs)  # the KV pool is allocated lazily (untouched pages)
    pool = list(range(1, num_blocks))
    random.Random(0).shuffle(pool)
    chunks = []
    for r in range(args.rows):
        length = args.context - r  # ragged, as real batches are
        req = Request(f"r{r}", list(range(length - 1)), SamplingParams())
        req.append_output(1)
        req.num_computed_tokens = length - 1
        chunks.append(ScheduledChunk(req, 1, pool[r * blocks_per_row:(r + 1) * blocks_per_row]))
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        runner._prepare(chunks)
        times.append(time.perf_counter() - t)
    print(f"{args.rows} decode rows x ~{args.context} tokens of context, block size {bs}: "
          f"_prepare median {statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms "
          f"({args.repeat} repeats)")


if __name__ == "__main__":
    main()
