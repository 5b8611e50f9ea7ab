"""Engine decode speed: the whole-stack compiled decode step vs the layer-by-layer Python path, and
quantized vs float32 weights, interleaved in one process (rounds alternate the configurations, so
a noisy machine hits them alike).

For each model: `auto` (the GGUF's own quantized types) with the decode stack, the same engine
with the stack turned off, and (for the demo) `--quantization none` float32. Each round generates
`--tokens` greedy tokens (EOS ignored) for `--rows` prompts at once and times the decode steps
only (steps after every prompt is prefilled). Prints tok/s medians and the machine's read bandwidth.

    .venv/bin/python benchmarks/decode_stack.py [--models demo,PATH.gguf] [--rows 1,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from decode_speed import read_bandwidth_gbs


def decode_rate(llm, rows: int, tokens: int) -> float:
    from brisk.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(rows):
        engine.add_request(llm.tokenizer.encode_chat([{"role": "user", "content": f"Story {i} about a dragon."}]),
                           params)
    produced, start = 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if start is None:
            if len(outs) == rows:  # the step that sampled every prompt's first token: decoding from here
                start = time.perf_counter()
            continue
        produced += sum(len(o.delta_token_ids) for o in outs)
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="demo")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from brisk.llm import LLM

    configs = []  # (label, llm, stack or None)
    for model in args.models.split(","):
        name = "smollm2-135m-instruct" if model == "demo" else model
        quantized = LLM(name, max_model_len=512, max_num_seqs=64)
        stack = quantized.engine.runner.decode_stack
        configs.append((f"{model} auto, decode stack", quantized, stack))
        configs.append((f"{model} auto, Python layers", quantized, None))
        if model == "demo":
            configs.append((f"{model} float32 (--quantization none)",
                            LLM(name, max_model_len=512, max_num_seqs=64, quantization="none"), None))
    rows_list = [int(r) for r in args.rows.split(",")]
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for rows in rows_list:
            for label, llm, stack in configs:
                llm.engine.runner.decode_stack = stack
                rates.setdefault((label, rows), []).append(decode_rate(llm, rows, args.tokens))
    bandwidth, how = read_bandwidth_gbs()
    print(f"machine read bandwidth: {bandwidth:.1f} GB/s ({how})")
    print(f"| configuration | rows | decode tok/s (median of {args.rounds}) | all rounds |")
    print("|---|---|---|---|")
    for (label, rows), values in rates.items():
        print(f"| {label} | {rows} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
