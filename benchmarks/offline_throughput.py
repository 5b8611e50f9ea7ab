"""Offline throughput: brisk's engine vs HF transformers `generate`, same run, same prompts.

Batch sizes 1/16/64 (all requests submitted at once), 64 output tokens each (EOS
ignored), greedy, fp32 on CPU. HF uses left-padded static batching.

    .venv/bin/python benchmarks/offline_throughput.py [--batches 1,16,64] [--tokens 64] [--skip-hf]
"""

from __future__ import annotations

import argparse
import time

import torch

from brisk.engine.sampling_params import SamplingParams
from brisk.llm import LLM

TOPICS = ["rivers", "volcanoes", "bread", "chess", "the moon", "bees", "trains", "jazz", "glaciers", "tea",
          "owls", "bridges", "deserts", "clocks", "whales", "paper"]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (#{i})."}] for i in range(n)]


def brisk_run(llm: LLM, batch: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = [llm.tokenizer.encode_chat(m) for m in prompts(batch)]
    start = time.perf_counter()
    outs = llm.generate(ids, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def hf_run(model, tokenizer, batch: int, tokens: int) -> float:
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts(batch)]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or 2)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - enc["input_ids"].shape[1]) * batch / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(max_model_len=2048, max_num_seqs=max(batches), max_num_batched_tokens=2048)
    brisk_run(llm, 2, 4)  # warm-up
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = llm.loaded.report.path
        from pathlib import Path

        p = Path(path)
        hf = (AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval(),
              AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name))
    print("| batch | brisk tok/s | HF generate tok/s | brisk / HF |")
    print("|---|---|---|---|")
    for batch in batches:
        ours = brisk_run(llm, batch, args.tokens)
        theirs = hf_run(*hf, batch, args.tokens) if hf else float("nan")
        print(f"| {batch} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
