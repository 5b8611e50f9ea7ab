"""`brisk doctor URL`: which silent killer hurts this endpoint, with the evidence and the fix."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from brisk.errors import BriskError
from brisk.fileio import output_path, write_output


def cmd_doctor(args: argparse.Namespace) -> int:
    from rich.console import Console

    from brisk.doctor import checks
    from brisk.doctor.budget import Budget
    from brisk.doctor.probe import Prober, require_openai
    from brisk.doctor.report import console_report, to_json, write_html

    for flag, path in (("--json", args.json_path), ("--html", args.html)):  # before the probes, not after
        if path is not None:
            output_path(path, flag)
    if args.budget is not None and args.budget <= 0:
        raise BriskError(f"--budget must be > 0 seconds, got {args.budget}")
    if args.max_concurrency < 1:
        raise BriskError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    console = Console(stderr=True)
    out = Console(width=None if sys.stdout.isatty() else 160)
    prober = Prober(args.url, args.api_key or os.environ.get("OPENAI_API_KEY"))
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    try:
        models = require_openai(prober)
        body = models["body"] if isinstance(models["body"], dict) else {}
        ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
        model = args.model or (ids[0] if ids else None)
        if model is None:
            raise BriskError(f"{args.url} lists no model; pass --model")
        total = Budget(args.budget if args.budget is not None else (60.0 if args.quick else 600.0) - 4.0,
                       fixed=args.quick)
        options = checks.Options(model=model, quick=args.quick, max_concurrency=args.max_concurrency,
                                 max_model_len=args.max_model_len, sample_file=args.sample_file,
                                 cold_wait_s=args.cold_wait,
                                 progress=lambda message: console.print(f"[dim]… {message}[/]"))
        measurements = {}

        weights = {"cold_start": 0.15, "network": 0.10, "context": 0.40, "kv_batching": 0.35}

        def run(area, check, *extra):
            """A check gets its weight's share of the time left, so what one leaves goes to the next."""
            later = list(weights)[list(weights).index(area):]
            options.budget = total.share_of_remaining(weights[area] / sum(weights[a] for a in later))
            return _guarded(area, check, prober, options, *extra)

        cold, measurements["cold_start"] = run("cold_start", checks.check_cold_start)
        total.start = time.monotonic() if cold.evidence.get("loading_seen") else total.start  # waiting: not ours
        steady = measurements["cold_start"].get("steady_ttft_s")
        network, measurements["network"] = run("network", checks.check_network, steady)
        context, measurements["context"] = run("context", checks.check_context, body)
        batching, measurements["concurrency"] = run("kv_batching", checks.check_concurrency)
        findings = [network, cold, batching, context]
    finally:
        prober.close()
    report = to_json(args.url, model, started, time.perf_counter() - t0, findings, measurements)
    report["budget_s"], report["skipped"] = total.total_s, total.skipped
    out.print(console_report(args.url, model, findings))
    for item in total.skipped:
        out.print(f"skipped (time budget): {item}")
    out.print(f"overall: {report['overall']} ({report['duration_s']:.0f} s)")
    if args.json_path:
        write_output(args.json_path, json.dumps(report, indent=1, default=str), "--json")
    if args.html:
        write_html(args.html, report)
    return 0


def _guarded(area: str, check, *args):
    """A check that crashes (a server answering nonsense) becomes an 'unknown' finding."""
    from brisk.doctor.checks import UNKNOWN, Finding

    try:
        return check(*args)
    except BriskError:
        raise
    except Exception as e:  # noqa: BLE001 - the doctor reports what it could not measure
        return Finding(area, UNKNOWN, f"could not examine: {type(e).__name__}: {e}"[:300], {}, [],
                       [f"{area} ({type(e).__name__})"]), {"error": f"{type(e).__name__}: {e}"[:300]}
