"""What `--batch-invariant` costs, and what it buys: the demo model served as int4, the engine
alone (no server), default mode and batch-invariant mode interleaved in one process.

  prefill   N prompts of ~L tokens, 1 generated token each, all submitted at once: prompt tok/s
  decode    16 short prompts, 64 greedy tokens each: output tok/s
  agreement 64 short prompts, 24 greedy tokens, alone vs all at once (4 prompts of ~300 tokens
            among them, chunked by the token budget): how many requests' tokens differ

    .venv/bin/python benchmarks/batch_invariant.py [--prompts 8] [--prompt-tokens 1500] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import read_bandwidth_gbs  # noqa: E402

from brisk.config import CacheConfig  # noqa: E402
from brisk.engine.engine import LLMEngine  # noqa: E402
from brisk.engine.sampling_params import SamplingParams  # noqa: E402
from brisk.engine.scheduler import SchedulerConfig  # noqa: E402
from brisk.loading.loader import load  # noqa: E402

WORDS = "river stone market bread water bird town street light house tree wind rain story music".split()


def engine(loaded, invariant: bool) -> LLMEngine:
    return LLMEngine(loaded, CacheConfig(num_gpu_blocks_override=4096, enable_prefix_caching=False),
                     SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=4096),
                     batch_invariant=invariant)


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return time.perf_counter() - start, [done[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    loaded = load("smollm2-135m-instruct")
    tok = loaded.tokenizer
    rng = random.Random(0)
    long = [tok.encode_chat([{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(
        args.prompt_tokens))}])[:args.prompt_tokens] for _ in range(args.prompts)]
    short = [tok.encode_chat([{"role": "user", "content": f"Tell me about {w} number {i}."}])
             for i, w in enumerate(WORDS * 5)][:60]
    short += [tok.encode_chat([{"role": "user", "content": "A" * 300 + str(i)}]) for i in range(4)]
    bandwidth, how = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}); {args.prompts} prompts of {len(long[0])} tokens")
    engines = {False: engine(loaded, False), True: engine(loaded, True)}
    prefill = {False: [], True: []}
    decode = {False: [], True: []}
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gen = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for _ in range(args.rounds):
        for mode, eng in engines.items():
            t, _ = run(eng, long, first)
            prefill[mode].append(sum(map(len, long)) / t)
            t, outs = run(eng, short[:16], gen)
            decode[mode].append(sum(map(len, outs)) / t)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    print("| mode | prefill prompt tok/s (median) | decode output tok/s, 16 streams (median) "
          "| requests whose greedy tokens differ, alone vs 64 at once |")
    print("|---|---|---|---|")
    for mode, eng in engines.items():
        alone = [run(eng, [p], greedy)[1][0] for p in short]
        _, together = run(eng, short, greedy)
        differ = sum(a != b for a, b in zip(alone, together))
        print(f"| {'batch-invariant' if mode else 'default'} | {statistics.median(prefill[mode]):.0f} | "
              f"{statistics.median(decode[mode]):.1f} | {differ} of {len(short)} |")


if __name__ == "__main__":
    main()
