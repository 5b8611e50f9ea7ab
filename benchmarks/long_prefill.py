"""Prompt processing of long prompts, per KV cache dtype, in one process with the rounds interleaved
(the prefill side of long-context serving: time to first token when the prompt is all there is).

For each --kv-dtype, one engine (the demo model unless --model, prefix caching off) takes --streams
requests of unique ~--context-token prompts at once and runs until each has its first token; only
that is timed. --rounds rounds, each starting one configuration later; each round gives every
configuration the same fresh prompts (prefix caching is off: nothing is reused). --baseline-lib: every engine also runs each round with another
build of brisk's kernels (a kernel change against the build before it), on the same engine.
Prints each configuration's median prompt tok/s and, with a baseline, the median of the rounds'
ratios.

    .venv/bin/python benchmarks/long_prefill.py [--kv-dtype float32,bfloat16] [--streams 4] [--context 2000]
        [--rounds 5] [--baseline-lib BEFORE/brisk/kernels/_kernels.so]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from decode_speed import read_bandwidth_gbs
from kv_decode import print_rates
from long_context import text


def prefill_rate(llm, prompts: list[str]) -> float:
    """Prompt tokens per second to each prompt's first token (all added at once)."""
    from brisk.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ids = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    for one in ids:
        llm.engine.add_request(one, params)
    done = 0
    for _ in range(10_000):  # bounded: a few steps per 2,048-token budget
        done += sum(1 for o in llm.engine.step() if o.finished)
        if done == len(ids):
            return sum(map(len, ids)) / (time.perf_counter() - start)
    raise RuntimeError(f"{len(ids) - done} prompts unfinished after 10,000 steps")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-dtype", default="float32,bfloat16,int8")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--context", type=int, default=2000, help="prompt tokens, roughly (one word ~ one token)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--baseline-lib", metavar="SO", type=Path,
                        help="also run every round with this build of the kernels (interleaved, same engines)")
    args = parser.parse_args()
    from brisk.llm import LLM

    dtypes = args.kv_dtype.split(",")
    builds = {"": None}
    if args.baseline_lib:
        from brisk import kernels

        builds = {"": kernels.library(), " baseline": kernels._bind(args.baseline_lib)}
    runs = [(dt, suffix) for dt in dtypes for suffix in builds]
    labels = [dt + suffix for dt, suffix in runs]
    bandwidth, how = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}); {args.streams} prompts of ~{args.context} tokens a run",
          flush=True)
    block_size, max_len = 8, int(args.context * 1.2) + 64  # a prompt, with room to spare
    num_blocks = args.streams * -(-max_len // block_size)
    engines = {dt: LLM(args.model, kv_cache_dtype=dt, max_model_len=max_len, enable_prefix_caching=False,
                       max_num_seqs=args.streams, max_num_batched_tokens=2048, num_blocks=num_blocks,
                       block_size=block_size) for dt in dtypes}
    rng = random.Random(0)
    rates: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(args.rounds):
        prompts = [f"Summarize this text:\n{text(int(args.context * 0.98), rng)}" for _ in range(args.streams)]
        for i in range(len(runs)):
            (dt, suffix), label = runs[(r + i) % len(runs)], labels[(r + i) % len(runs)]
            if builds[suffix] is not None:
                kernels._lib = builds[suffix]  # the build every kernel call of the steps goes to
            rates[label].append(prefill_rate(engines[dt], prompts))
        print(f"  round {r + 1}: " + ", ".join(f"{label} {rates[label][-1]:.0f}" for label in labels), flush=True)
    after, _ = read_bandwidth_gbs()
    print(f"read bandwidth after {after:.1f} GB/s")
    print_rates(rates, labels, "KV dtype", f"prompt tok/s (median of {args.rounds} rounds)",
                args.baseline_lib is not None, 0)

if __name__ == "__main__":
    main()
