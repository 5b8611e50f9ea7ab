"""`brisk bench` flags (no heavy imports: `brisk --help` stays instant)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (or env OPENAI_API_KEY)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="requests kept in flight (default 8)")
    mode.add_argument("--request-rate", type=float, default=None, help="requests/s, Poisson or gamma arrivals")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap in-flight requests with --request-rate")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    p.add_argument("--sweep", default=None, help="concurrency=1,2,4,... or rate=0.5,1,2,...")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and not measured")
    p.add_argument("--repeat", type=int, default=1, help="run each level this many times, each with fresh prompts")
    p.add_argument("--duration", type=float, default=None, help="stop issuing requests after this many seconds")
    p.add_argument("--workload", default="synthetic", choices=["synthetic", "shared-prefix", "sharegpt", "replay"])
    p.add_argument("--input-len", default="256", help="prompt length distribution (see docs), e.g. "
                                                      "lognormal:mean=512,sigma=0.8,min=16,max=2048")
    p.add_argument("--output-len", default="64", help="output length distribution, same syntax")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: number of distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per prefix")
    p.add_argument("--dataset", type=Path, default=None, help="sharegpt: the ShareGPT JSON file")
    p.add_argument("--trace", type=Path, default=None,
                   help="replay: a trace (brisk serve --request-log, or JSONL of arrival_s, prompt_tokens, "
                        "output_tokens)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="synthetic prompts go to /v1/completions (exact lengths) or /v1/chat/completions")
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    p.add_argument("--goodput", nargs="*", default=None, metavar="SLO", help="e.g. ttft:500 tpot:50 e2el:2000 (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", type=Path, default=None, dest="json_path", help="write results as JSON")
    p.add_argument("--result-format", default="brisk", choices=["brisk", "vllm"],
                   help="--json layout: brisk (every run in one file) or vllm (the keys of `vllm bench serve "
                        "--save-result`, one file per run: NAME.json, or NAME-LABEL.json for several runs)")
    p.add_argument("--csv", type=Path, default=None, help="write one summary row per run")
    p.add_argument("--plot", type=Path, default=None, help="directory for PNG plots")
