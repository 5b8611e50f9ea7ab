"""Where one decode step's time goes: --streams streams of ~--context-token prompts (kv_decode.py's
engines), then --steps decode steps, each timed whole and in parts:

  stack    the decode stack's one compiled call (brisk/kernels/decoder.cpp: every layer's matmuls,
           norms, RoPE, KV writes and decode attention)
  logits   the lm_head on the last hidden states (model.compute_logits)
  sampler  the sampler (greedy here: an argmax per row)
  prepare  the host-side batch and attention metadata (ModelRunner._prepare)
  rest     the step's remainder: the scheduler, the embeddings, the outputs

Run it at a short and a long --context: the stack's growth between them is decode attention, and
what does not grow caps what a narrower KV cache can gain (issue 35).

    .venv/bin/python benchmarks/step_parts.py [--context 300] [--kv-dtype float32] [--streams 16]
        [--steps 40] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

from kv_decode import build
from long_context import text


def timed(obj, name: str, spent: dict[str, float], key: str) -> None:
    """Wrap obj.name (an instance attribute) so that its calls add their wall time to spent[key]."""
    call = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=300, help="prompt tokens, roughly (one word ~ one token)")
    parser.add_argument("--kv-dtype", default="float32")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [f"Continue this text:\n{text(int(args.context * 0.98), rng)}" for _ in range(args.streams)]
    # the pool sized for at least 300-token prompts: 16 streams' pool must also hold one 4,096-token sequence
    llm, mean_len = build(args.model, args.kv_dtype, 8, prompts, args.steps + 8, max(args.context, 300))
    runner = llm.engine.runner
    if runner.decode_stack is None:
        raise SystemExit("this model's decode steps do not take the compiled decode stack: nothing to split")
    spent: dict[str, float] = defaultdict(float)
    timed(runner, "decode_stack", spent, "stack")
    timed(runner.model, "compute_logits", spent, "logits")
    timed(runner, "sampler", spent, "sampler")
    timed(runner, "_prepare", spent, "prepare")
    for _ in range(4):  # warm, and out of the prefill's shadow
        llm.engine.step()
    spent.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        outs = llm.engine.step()
        if len(outs) != args.streams:
            raise RuntimeError(f"a step decoded {len(outs)} of {args.streams} streams")
    step = (time.perf_counter() - start) / args.steps * 1e3
    parts = {key: spent[key] / args.steps * 1e3 for key in ("stack", "logits", "sampler", "prepare")}
    parts["rest"] = step - sum(parts.values())
    print(f"{args.streams} streams of ~{mean_len:.0f} prompt tokens, {args.kv_dtype} KV, {args.steps} steps")
    print("| step ms | " + " | ".join(parts) + " |")
    print("|---|" + "---|" * len(parts))
    print(f"| {step:.2f} | " + " | ".join(f"{v:.2f}" for v in parts.values()) + " |")


if __name__ == "__main__":
    main()
