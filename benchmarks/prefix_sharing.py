"""Prefix sharing: 32 requests sharing a ~1,000-token system prompt, prefix caching on vs off.

Reports mean/p50/max TTFT (arrival -> first token, engine timestamps), wall time and
peak KV blocks in use.

    .venv/bin/python benchmarks/prefix_sharing.py
"""

from __future__ import annotations

import statistics
import time

import brisk  # noqa: F401

from brisk.engine.sampling_params import SamplingParams
from brisk.llm import LLM

SYSTEM = ("You are the support assistant of a railway company. Answer politely, cite the timetable, "
          "never invent connections, and keep answers short. ") * 38


def run(prefix_caching: bool) -> dict:
    llm = LLM(max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=2048,
              enable_prefix_caching=prefix_caching)
    ids = [llm.tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"When does train {i} leave?"}]) for i in range(32)]
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for p in ids:
        engine.add_request(p, params)
    peak, finals = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals.append(out)
        peak = max(peak, engine.stats().kv_blocks_used)
    wall = time.perf_counter() - start
    ttfts = [o.metrics["ttft_ms"] for o in finals]
    return {"prompt_tokens": len(ids[0]), "ttft_mean": statistics.mean(ttfts), "ttft_p50": statistics.median(ttfts),
            "ttft_max": max(ttfts), "wall_s": wall, "peak_blocks": peak,
            "hit_tokens": engine.stats().prefix_cache_hits_tokens}


def main() -> None:
    print("| prefix caching | prompt tokens | TTFT mean ms | TTFT p50 ms | TTFT max ms | wall s | peak KV blocks | prefix-hit tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for on in (True, False):
        r = run(on)
        print(f"| {'on' if on else 'off'} | {r['prompt_tokens']} | {r['ttft_mean']:.0f} | {r['ttft_p50']:.0f} | "
              f"{r['ttft_max']:.0f} | {r['wall_s']:.1f} | {r['peak_blocks']} | {r['hit_tokens']} |", flush=True)


if __name__ == "__main__":
    main()
