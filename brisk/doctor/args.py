"""`brisk doctor` flags (no heavy imports)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="base URL of any OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (or env OPENAI_API_KEY)")
    p.add_argument("--quick", action="store_true",
                   help="fewer, smaller probes, within a one-minute budget (what does not fit is listed as skipped)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds the probes may take in all (default 56 with --quick, 596 without; waiting for a "
                        "loading server does not count)")
    p.add_argument("--max-concurrency", type=int, default=16, help="highest concurrency of the ramp (default 16)")
    p.add_argument("--max-model-len", type=int, default=None, help="context window, if the server does not say")
    p.add_argument("--sample-file", default=None, help="your own text: report its tokens per character")
    p.add_argument("--cold-wait", type=float, default=120.0, help="seconds to wait for a loading server")
    p.add_argument("--json", default=None, dest="json_path", help="write the report as JSON")
    p.add_argument("--html", default=None, help="write a self-contained HTML report with plots")
