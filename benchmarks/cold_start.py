"""Cold start: process start -> first generated token, in fresh processes.

Cases: brisk with a warm conversion cache, brisk on first use of the GGUF (empty
cache), and HF transformers loading the same GGUF. Prints a markdown table.

    .venv/bin/python benchmarks/cold_start.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "What is the capital of France?"

BRISK = f"""
from brisk.loading.loader import load
from brisk.generate import generate_ids
m = load()
ids = m.tokenizer.encode_chat([{{"role": "user", "content": {PROMPT!r}}}])
next(generate_ids(m, ids, max_tokens=1))
print("FIRST_TOKEN", flush=True)
"""

HF = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from brisk.models.registry import resolve
p = resolve(None).path
tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
ids = tok.apply_chat_template([{{"role": "user", "content": {PROMPT!r}}}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
model.generate(**ids, max_new_tokens=1, do_sample=False)
print("FIRST_TOKEN", flush=True)
"""


def time_to_first_token(code: str, env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    for line in proc.stdout:
        if line.startswith("FIRST_TOKEN"):
            elapsed = time.perf_counter() - start
            proc.wait(timeout=120)
            return elapsed
    raise RuntimeError(f"process exited with {proc.wait()} before a first token")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    base_env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    results: dict[str, list[float]] = {"brisk, warm conversion cache": [], "brisk, first use of the GGUF": [],
                                       "HF transformers from the GGUF": []}
    with tempfile.TemporaryDirectory() as warm_cache:
        warm_env = {**base_env, "BRISK_CACHE": warm_cache}
        time_to_first_token(BRISK, warm_env)  # fill the cache
        for _ in range(args.runs):
            results["brisk, warm conversion cache"].append(time_to_first_token(BRISK, warm_env))
            with tempfile.TemporaryDirectory() as cold_cache:
                results["brisk, first use of the GGUF"].append(
                    time_to_first_token(BRISK, {**base_env, "BRISK_CACHE": cold_cache}))
            results["HF transformers from the GGUF"].append(time_to_first_token(HF, base_env))
    print(f"| case | process start -> first token, median of {args.runs} (s) | runs (s) |")
    print("|---|---|---|")
    for name, times in results.items():
        print(f"| {name} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    main()
