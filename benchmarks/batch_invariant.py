"""What batch invariance (the default; `--no-batch-invariant` turns it off) costs, and what it
buys: the demo model served as int4, the engine alone (no server), both modes interleaved in one
process.

  prefill   N prompts of ~L tokens, 1 generated token each, all submitted at once: prompt tok/s
  decode    16 short prompts, 64 greedy tokens each: output tok/s
  streams   16 prompts of ~S tokens, 128 greedy tokens each, all at once (prefill and decode
            mixed, as a server at 16 streams sees them): output tok/s and total tok/s
  agreement 64 short prompts, 24 greedy tokens, alone vs all at once (4 prompts of ~300 tokens
            among them, chunked by the token budget): how many requests' tokens differ
  cache     60 prompts behind one long system prompt, 48 greedy tokens: each alone on a fresh
            engine (cold) vs one after another on one engine with prefix caching (the system
            prompt cached): how many differ

    .venv/bin/python benchmarks/batch_invariant.py [--prompts 8] [--prompt-tokens 1500]
        [--stream-prompt-tokens 1000] [--rounds 2]
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


def engine(loaded, invariant: bool, prefix: bool = False) -> LLMEngine:
    return LLMEngine(loaded, CacheConfig(num_gpu_blocks_override=4096, enable_prefix_caching=prefix),
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
    parser.add_argument("--stream-prompt-tokens", type=int, default=1000)
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
    streams = [tok.encode_chat([{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(
        args.stream_prompt_tokens))}])[:args.stream_prompt_tokens] for _ in range(16)]
    system = {"role": "system", "content": "You are a patient tutor who answers in full sentences. " * 6}
    behind = [tok.encode_chat([system, {"role": "user", "content": f"Tell me one fact about {w} number {i}."}])
              for i, w in enumerate(WORDS * 4)]
    bandwidth, how = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}); {args.prompts} prompts of {len(long[0])} tokens")
    engines = {False: engine(loaded, False), True: engine(loaded, True)}
    prefill = {False: [], True: []}
    decode = {False: [], True: []}
    mixed = {False: [], True: []}
    long_gen = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gen = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for _ in range(args.rounds):
        for mode, eng in engines.items():
            t, _ = run(eng, long, first)
            prefill[mode].append(sum(map(len, long)) / t)
            t, outs = run(eng, short[:16], gen)
            decode[mode].append(sum(map(len, outs)) / t)
            t, outs = run(eng, streams, long_gen)
            mixed[mode].append((sum(map(len, outs)) / t, (sum(map(len, outs)) + sum(map(len, streams))) / t))
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reply = SamplingParams(max_tokens=48, temperature=0)
    print(f"| mode | prefill prompt tok/s | decode output tok/s, 16 streams | 16 streams x {len(streams[0])}-token "
          "prompts + 128 tokens: output tok/s (total tok/s) | differ, alone vs 64 at once | differ, cold vs "
          "cached system prompt |")
    print("|---|---|---|---|---|---|")
    for mode, eng in engines.items():
        alone = [run(eng, [p], greedy)[1][0] for p in short]
        _, together = run(eng, short, greedy)
        differ = sum(a != b for a, b in zip(alone, together))
        cold = [run(engine(loaded, mode, prefix=True), [p], reply)[1][0] for p in behind]
        warm_engine = engine(loaded, mode, prefix=True)
        warm = [run(warm_engine, [p], reply)[1][0] for p in behind]
        cached = sum(a != b for a, b in zip(cold, warm))
        out_tps = statistics.median(m[0] for m in mixed[mode])
        all_tps = statistics.median(m[1] for m in mixed[mode])
        print(f"| {'batch-invariant (default)' if mode else '--no-batch-invariant'} | "
              f"{statistics.median(prefill[mode]):.0f} | {statistics.median(decode[mode]):.1f} | "
              f"{out_tps:.1f} ({all_tps:.0f}) | {differ} of {len(short)} | {cached} of {len(behind)} |")


if __name__ == "__main__":
    main()
