"""`brisk kv-plan` flags (no heavy imports)."""

from __future__ import annotations

import argparse
from pathlib import Path

from brisk.kv_dtype import parse_name as kv_dtype_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("traffic (a trace, or distributions)")
    src.add_argument("--trace", type=Path, default=None,
                     help="a trace (JSONL: brisk serve --request-log, kv-plan --save-trace, or "
                          "arrival_s/prompt_tokens/output_tokens per line) or a brisk bench --json file")
    src.add_argument("--prompt-len", default="lognormal:mean=600,sigma=0.9,min=16,max=4000",
                     help="without --trace: prompt length distribution (brisk bench syntax)")
    src.add_argument("--output-len", default="lognormal:mean=250,sigma=0.8,min=8,max=2000")
    src.add_argument("--rate", type=float, default=4.0, help="without --trace: requests/s (Poisson)")
    src.add_argument("--num-requests", type=int, default=2000)
    src.add_argument("--seed", type=int, default=0)
    mem = p.add_argument_group("memory and model")
    mem.add_argument("--memory", default="2GiB", help="KV memory budget, e.g. 2GiB")
    mem.add_argument("--model", default=None, help="model dir, .gguf or catalog name, for bytes per token "
                                                    "(default: the demo model)")
    mem.add_argument("--kv-dtype", default="auto", type=kv_dtype_name,
                     help="KV cache dtype, as brisk serve's --kv-cache-dtype (auto: what brisk serve picks on this "
                          "machine for a float32 model); the recommended flags carry it")
    mem.add_argument("--bytes-per-token", type=int, default=None, help="override the model's KV bytes per token")
    mem.add_argument("--host-bytes", default=None, metavar="BYTES",
                     help="size brisk serve's KV host tier (--kv-cache-host-bytes, e.g. 8GiB): how many tokens of "
                          "evicted prefixes it keeps, against the pool and this traffic's prompts")
    mem.add_argument("--disk-bytes", default=None, metavar="BYTES",
                     help="size brisk serve's KV disk tier (--kv-cache-disk-bytes, e.g. 16GiB): how many tokens of "
                          "cached prompts it holds, against this traffic's prompts")
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    eng.add_argument("--max-tokens", type=int, default=None,
                     help="max_tokens clients ask for when the trace has none (default: the rest of the window)")
    from brisk.engine.scheduler import SchedulerConfig  # torch-free: brisk serve's defaults, from one place

    eng.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                     help=f"as brisk serve's flag (default {SchedulerConfig.max_num_seqs}, its default)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                     help="as brisk serve's flag: the step's token budget; longer prompts are prefilled in chunks "
                          f"(default {SchedulerConfig.max_num_batched_tokens}, its default)")
    eng.add_argument("--no-prefix-caching", action="store_true", help="as brisk serve's flag")
    eng.add_argument("--decode-tps", type=float, default=20.0,
                     help="generation speed per sequence, tokens/s: a step takes 1/decode-tps s (brisk bench's "
                          "TPOT is 1000/decode-tps ms)")
    eng.add_argument("--prefill-tps", type=float, default=2000.0,
                     help="prompt tokens prefilled per second; a step also takes its prompt tokens / prefill-tps "
                          "(brisk doctor reports the prefill cost per 1k tokens)")
    eng.add_argument("--block-sizes", default="8,16,32,64,128")
    eng.add_argument("--buckets", default="auto",
                     help="bucketed pools as slot sizes:memory shares, e.g. 1024,2048,8192:0.5,0.3,0.2 "
                          "(auto: max_model_len/8, /4, /2 and max_model_len, equal shares)")
    eng.add_argument("--rebalance-every", type=int, default=100, help="steps between bucket rebalances")
    p.add_argument("--save-trace", type=Path, default=None, help="write the requests simulated as JSONL")
    p.add_argument("--json", type=Path, default=None, dest="json_path")
    p.add_argument("--plot", type=Path, default=None, help="directory for PNG plots")
