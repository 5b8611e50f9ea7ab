"""Prefill cost of a burst: 64 short chat prompts arriving at once, one output token each,
prefix caching on vs off. Bounds the TTFT any scheduler can give the last request of a
burst on this machine (DESIGN.md: fp32 matmuls are compute-bound near the CPU's peak).

    .venv/bin/python benchmarks/prefill_burst.py [--n 64] [--budget 2048] [--block-sizes 16,8]
"""

from __future__ import annotations

import argparse
import time

from brisk.engine.sampling_params import SamplingParams
from brisk.llm import LLM

TOPICS = ["rivers", "volcanoes", "bread", "chess", "the moon", "bees", "trains", "jazz", "glaciers", "tea",
          "owls", "bridges", "deserts", "clocks", "whales", "paper"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--block-sizes", default="16", help="comma-separated KV block sizes to compare")
    args = parser.parse_args()
    print("| block size | prefix caching | prompt tokens | computed tokens | burst prefill s | computed tok/s |")
    print("|---|---|---|---|---|---|")
    for block_size, prefix in [(int(b), p) for b in args.block_sizes.split(",") for p in (True, False)]:
        llm = LLM(max_model_len=2048, max_num_seqs=args.n, max_num_batched_tokens=args.budget,
                  enable_prefix_caching=prefix, block_size=block_size)
        llm.generate([llm.tokenizer.encode("warm up")], SamplingParams(max_tokens=1))
        llm.engine.kv.pool.reset_prefix_cache()
        ids = [llm.tokenizer.encode_chat([{"role": "user", "content": f"Tell me about {TOPICS[i % 16]} (#{i})."}])
               for i in range(args.n)]
        hits_before = llm.engine.stats().prefix_cache_hits_tokens
        start = time.perf_counter()
        llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))
        elapsed = time.perf_counter() - start
        total = sum(map(len, ids))
        computed = total - (llm.engine.stats().prefix_cache_hits_tokens - hits_before)
        print(f"| {block_size} | {'on' if prefix else 'off'} | {total} | {computed} | {elapsed:.2f} | {computed / elapsed:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
