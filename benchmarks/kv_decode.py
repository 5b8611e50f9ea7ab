"""Long-context decode per KV cache dtype, in one process, with the rounds interleaved (issue 35's
"long-context decode" figure, without prompt processing in the timed steps).

For each --kv-dtype, one engine (the demo model unless --model) holds --streams requests with unique
~--context-token prompts (long_context.py's word prompts; prefix caching off, so no two rows share a
block), prefilled once; with several --block-size values, one engine per dtype and block size.
Then --rounds rounds: each steps every engine --steps decode steps in turn,
starting one engine later each round, and times only those steps. Every timed step decodes all
streams (checked), so a step reads every stream's whole context from the pool. Prints each dtype's
median tok/s over the rounds, its ratio to the first configuration's, and the read-bandwidth probe before and after.
--baseline-lib: every engine is also stepped, in the same rounds, with another build of brisk's
kernels (a kernel change against the build before it, on the very same engines and contexts).
long_context.py's workload d measures the same through the server, one dtype after another.

    .venv/bin/python benchmarks/kv_decode.py [--kv-dtype float32,bfloat16,fp8,fp8_e5m2,int8] [--block-size 8]
        [--streams 16] [--context 2000] [--steps 16] [--rounds 5] [--model smollm2-135m-instruct]
        [--baseline-lib BEFORE/brisk/kernels/_kernels.so]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from decode_speed import read_bandwidth_gbs
from long_context import text


def build(model: str, kv_dtype: str, block_size: int, prompts: list[str], max_new: int, context: int):
    from brisk.engine.sampling_params import SamplingParams
    from brisk.llm import LLM

    streams = len(prompts)
    # blocks: the prompt, the timed steps and the steps the first prompts decode while the others
    # prefill (one per prefill step), with room to spare; an unfinished request holds only what it wrote
    prefill_steps = streams * context // 2048 + streams
    per_stream = -(-(int(context * 1.2) + max_new + prefill_steps + 64) // block_size)
    llm = LLM(model, kv_cache_dtype=kv_dtype, max_model_len=4096, enable_prefix_caching=False,
              max_num_seqs=streams, max_num_batched_tokens=2048, num_blocks=streams * per_stream,
              block_size=block_size)
    params = SamplingParams(max_tokens=max_new + prefill_steps + 16, temperature=0, ignore_eos=True)
    lengths = []
    for p in prompts:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": p}])
        lengths.append(len(ids))
        llm.engine.add_request(ids, params)
    started: set[str] = set()
    while len(started) < streams:  # prefill every prompt (and sample its first token)
        started.update(o.request_id for o in llm.engine.step())
    return llm, statistics.mean(lengths)


def timed_steps(llm, steps: int, streams: int) -> float:
    produced = 0
    start = time.perf_counter()
    for _ in range(steps):
        outs = llm.engine.step()
        if len(outs) != streams:
            raise RuntimeError(f"a step decoded {len(outs)} of {streams} streams (preempted or finished?)")
        produced += sum(len(o.delta_token_ids) for o in outs)
    return produced / (time.perf_counter() - start)


def print_rates(rates: dict[str, list[float]], labels: list[str], first: str, measure: str, baseline: bool,
                digits: int) -> None:
    """The rounds' rates as a Markdown table: each label's median, range and ratio to the first label's;
    with `baseline` (labels "X" and "X baseline": two builds on one configuration), the median and range
    of each round's X / X baseline ratio too."""
    base = statistics.median(rates[labels[0]])
    print(f"| {first} | {measure} | min-max | vs {labels[0]} |"
          + (" this build vs baseline (median of the rounds' ratios) |" if baseline else ""))
    print("|---|---|---|---|" + ("---|" if baseline else ""))
    for label in labels:
        med = statistics.median(rates[label])
        row = (f"| {label} | {med:.{digits}f} | {min(rates[label]):.{digits}f}-{max(rates[label]):.{digits}f} "
               f"| {med / base:.2f}x |")
        if baseline and not label.endswith(" baseline"):
            ratios = [a / b for a, b in zip(rates[label], rates[label + " baseline"])]
            row += f" {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        elif baseline:
            row += " |"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-dtype", default="float32,bfloat16,fp8,fp8_e5m2,int8")
    parser.add_argument("--block-size", default="8", help="KV block sizes (comma-separated: each dtype at each)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--context", type=int, default=2000, help="prompt tokens, roughly (one word ~ one token)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--baseline-lib", metavar="SO", type=Path,
                        help="also step every engine with this build of brisk/kernels/_kernels.so")
    args = parser.parse_args()
    configs = [(dt, int(bs)) for bs in args.block_size.split(",") for dt in args.kv_dtype.split(",")]
    dtypes = [f"{dt}/{bs}" for dt, bs in configs]  # labels: an engine each
    builds = {"": None}  # label suffix -> kernel library (None: this checkout's)
    if args.baseline_lib:
        from brisk import kernels

        builds = {"": kernels.library(), " baseline": kernels._bind(args.baseline_lib)}
    runs = [(dt, suffix) for dt in dtypes for suffix in builds]  # what a round steps, in turn
    labels = [dt + suffix for dt, suffix in runs]
    rng = random.Random(0)
    prompts = [f"Continue this text:\n{text(int(args.context * 0.98), rng)}"
               for _ in range(args.streams)]
    bandwidth, how = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}); {args.streams} streams", flush=True)
    engines = {}
    for dt, (kv, bs) in zip(dtypes, configs):
        t0 = time.perf_counter()
        engines[dt], mean_len = build(args.model, kv, bs, prompts, 2 + args.steps * args.rounds * len(builds),
                                      args.context)
        print(f"  {dt}: {args.streams} prompts of {mean_len:.0f} tokens prefilled in {time.perf_counter() - t0:.0f} s",
              flush=True)
    rates: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for i in range(len(runs)):
            (dt, suffix), label = runs[(r + i) % len(runs)], labels[(r + i) % len(runs)]
            if builds[suffix] is not None:
                kernels._lib = builds[suffix]  # the build every kernel call of the step goes to
            rates[label].append(timed_steps(engines[dt], args.steps, args.streams))
        print(f"  round {r + 1}: " + ", ".join(f"{label} {rates[label][-1]:.1f}" for label in labels), flush=True)
    after, _ = read_bandwidth_gbs()
    print(f"read bandwidth after {after:.1f} GB/s")
    print_rates(rates, labels, "KV dtype / block size",
                f"decode tok/s (median of {args.rounds} rounds x {args.steps} steps)", args.baseline_lib is not None, 1)


if __name__ == "__main__":
    main()
