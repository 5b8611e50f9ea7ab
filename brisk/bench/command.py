"""`brisk bench URL`: load an OpenAI-compatible endpoint and report vLLM-comparable metrics."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx
import numpy as np

from brisk.bench.client import BenchRequest, run_schedule
from brisk.loop_lag import LoopLagMonitor
from brisk.bench.metrics import SLO, summarize
from brisk.bench.report import RunResult, console_table, write_csv, write_json, write_plots
from brisk.bench import workloads as wl
from brisk.errors import BriskError
from brisk.fileio import output_path


def parse_goodput(items: list[str] | None) -> SLO | None:
    if items is None:
        return None
    limits = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise BriskError(f"--goodput {item!r}: the SLO names are ttft, tpot and e2el (milliseconds)")
        try:
            limits[f"{key}_ms" if key != "e2el" else "e2el_ms"] = float(value)
        except ValueError:
            raise BriskError(f"--goodput {item!r}: give a number of milliseconds, e.g. {key}:500") from None
    if not limits:
        raise BriskError("--goodput needs at least one SLO, e.g. --goodput ttft:500 tpot:50")
    return SLO(**limits)


def parse_sweep(spec: str | None) -> tuple[str, list[float]] | None:
    if spec is None:
        return None
    knob, _, values = spec.partition("=")
    if knob not in ("concurrency", "rate"):
        raise BriskError(f"--sweep {spec!r}: sweep concurrency=1,2,4 or rate=0.5,1,2")
    try:
        parsed = [float(v) for v in values.split(",") if v]
    except ValueError:
        parsed = []
    if not parsed or any(v <= 0 for v in parsed):
        raise BriskError(f"--sweep {spec!r}: give positive numbers separated by commas")
    return knob, parsed


class Server:
    """What the bench learns from the endpoint before loading it."""

    def __init__(self, url: str, api_key: str | None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.counter = None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=30)

    def model(self, wanted: str | None) -> str:
        try:
            resp = self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise BriskError(f"cannot reach {self.url} ({type(e).__name__}: {e}); is the server running?") from None
        if resp.status_code == 401:
            raise BriskError(f"{self.url} answered 401: give --api-key (or set OPENAI_API_KEY)")
        if resp.status_code != 200:
            raise BriskError(f"{self.url}/v1/models answered HTTP {resp.status_code}; is this an OpenAI-compatible "
                             "server?")
        try:
            ids = [m["id"] for m in resp.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise BriskError(f"{self.url}/v1/models did not return an OpenAI model list") from None
        if wanted is not None:
            return wanted
        if not ids:
            raise BriskError(f"{self.url} lists no models; pass --model")
        return ids[0]

    def token_counter(self, model: str):
        """A counter backed by POST /tokenize when the server has one (brisk, vLLM), else None."""
        def count(text: str) -> int:
            resp = self.http.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
            resp.raise_for_status()
            return int(resp.json()["count"])

        try:
            count("hello world")
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return None
        self.counter = count
        return count


def build_workload(args, server: Server, model: str, n: int, draw: int = 0) -> tuple[list[BenchRequest],
                                                                                   list[float] | None]:
    """`n` requests for one run. Every run (`draw`: 0 = warm-up, 1.. = each sweep level or repeat)
    gets prompts of its own, so a server's prefix cache cannot serve a later level from an
    earlier one's prompts; only a shared-prefix workload shares (its prefixes, on purpose)."""
    rng = np.random.default_rng([args.seed, draw])
    counter = server.counter if server.counter is not None else server.token_counter(model)
    maker = wl.PromptMaker(rng, counter)
    extra = {"temperature": 0.0}
    if not args.no_ignore_eos:
        extra["ignore_eos"] = True
    outputs = wl.parse_length_dist(args.output_len, "--output-len")
    if n < 1:
        raise BriskError("--num-requests must be >= 1")
    arrivals = None  # a replay's are the trace's; the others' come from the run's rate or concurrency
    if args.workload == "synthetic":
        reqs = wl.synthetic(maker, rng, n, wl.parse_length_dist(args.input_len, "--input-len"), outputs, extra)
    elif args.workload == "shared-prefix":
        prefix_maker = wl.PromptMaker(np.random.default_rng(args.seed), counter)  # the same prefixes in every run
        reqs = wl.shared_prefix(maker, rng, n, args.num_prefixes, args.prefix_len,
                                wl.parse_length_dist(args.input_len, "--input-len"), outputs, extra,
                                prefix_maker=prefix_maker)
    elif args.workload == "sharegpt":
        if args.dataset is None:
            raise BriskError("--workload sharegpt needs --dataset FILE (ShareGPT JSON)")
        reqs = wl.sharegpt(args.dataset, np.random.default_rng(args.seed), n, counter,
                           int(outputs.high if outputs.kind != "fixed" else outputs.mean), extra, skip=draw_offset(
                               args, draw))
    else:
        if args.trace is None:
            raise BriskError("--workload replay needs --trace FILE (a brisk serve --request-log, or JSONL with "
                             "arrival_s, prompt_tokens, output_tokens)")
        reqs, arrivals, note = wl.replay(args.trace, maker, None, extra)
        if note:
            print(f"--trace {args.trace}: {note}", file=sys.stderr)
    if args.endpoint == "chat":
        for r in reqs:
            if r.prompt is not None:
                r.messages, r.prompt = [{"role": "user", "content": r.prompt}], None
    return reqs, arrivals


def draw_offset(args, draw: int) -> int:
    """Where run `draw` starts in the dataset: the warm-up first, then each run after the last."""
    return 0 if draw == 0 else args.warmup + (draw - 1) * args.num_requests


def _runs(args) -> list[tuple[str, str, float | None]]:
    sweep = parse_sweep(args.sweep)
    if args.workload == "replay":
        return [("replay", "replay", None)]
    if sweep is not None:
        knob, values = sweep
        return [(f"{knob}={v:g}", knob, v) for v in values]
    if args.request_rate is not None:
        return [(f"rate={args.request_rate:g}", "rate", args.request_rate)]
    c = args.concurrency or 8
    return [(f"concurrency={c}", "concurrency", c)]


def cmd_bench(args: argparse.Namespace) -> int:
    import os

    from rich.console import Console

    from brisk.progress import Progress

    console = Console(stderr=True)
    for name in ("concurrency", "max_concurrency"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise BriskError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.repeat < 1:
        raise BriskError(f"--repeat must be >= 1, got {args.repeat}")
    slo = parse_goodput(args.goodput)
    for flag, path in (("--json", args.json_path), ("--csv", args.csv)):  # before the run, not after it
        if path is not None:
            output_path(path, flag)
    server = Server(args.url, args.api_key or os.environ.get("OPENAI_API_KEY"))
    model = server.model(args.model)
    runs = _runs(args)
    common = dict(api_key=server.api_key, timeout_s=args.timeout)
    if args.workload != "replay" and args.warmup > 0:  # a trace is replayed as recorded, without warm-up
        warmup, _ = build_workload(args, server, model, args.warmup, draw=0)
        asyncio.run(run_schedule(server.url, model, warmup, max_concurrency=min(len(warmup), 4), **common))
    results = []
    rng = np.random.default_rng(args.seed + 1)
    draw = 0
    for label, knob, value in runs:
        for repeat in range(args.repeat):
            draw += 1
            measured, trace_arrivals = build_workload(args, server, model, args.num_requests, draw)
            arrivals, cap = trace_arrivals, args.max_concurrency
            if knob == "concurrency":
                cap = int(value)
            elif knob == "rate":
                arrivals = wl.arrival_offsets(len(measured), value, args.burstiness, rng)
            run_label = label if args.repeat == 1 else f"{label} #{repeat + 1}"
            monitor = LoopLagMonitor()
            with Progress(run_label, len(measured)) as progress:
                records = asyncio.run(run_schedule(
                    server.url, model, measured, arrivals=arrivals, max_concurrency=cap, duration_s=args.duration,
                    monitor=monitor, on_done=lambda _: progress.advance(), **common))
            if not records:
                raise BriskError(f"{run_label}: no request was sent (is --duration too short?)")
            results.append(RunResult(run_label, knob, value, records, summarize(records, slo), monitor.p99_ms,
                                     cap))

    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(console_table(results, console.width))
    _print_warnings(console, results, args)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_url": server.url, "model_id": model,
            "endpoint": args.endpoint, "workload": args.workload, "input_len": args.input_len,
            "output_len": args.output_len, "num_prompts": len(results[0].records), "burstiness": args.burstiness,
            "ignore_eos": not args.no_ignore_eos, "exact_prompt_lengths": server.counter is not None,
            "fresh_prompts_per_run": args.workload not in ("shared-prefix", "replay"),  # replay: its prefix groups
            "goodput_slo": None if slo is None else {k: v for k, v in vars(slo).items() if v is not None}}
    if args.json_path:
        for path in write_json(args.json_path, meta, results, args.result_format):
            console.print(f"results: {path}")
    if args.csv:
        write_csv(args.csv, results)
    if args.plot:
        for path in write_plots(args.plot, results):
            console.print(f"plot: {path}")
    if all(r.summary.completed == 0 for r in results):
        first = next(iter(results[0].summary.errors), "unknown")
        raise BriskError(f"every request failed; first error: {first}")
    return 0


INTENDED_HIT_RATE = 0.25  # above this, a fresh-prompt workload is being served from the cache


def _print_warnings(console, results: list[RunResult], args) -> None:
    for r in results:
        rate = r.summary.prefix_cache_hit_rate
        if rate is not None and args.workload != "shared-prefix" and rate > INTENDED_HIT_RATE:
            console.print(f"[yellow]warning[/]: {r.label}: {rate:.0%} of prompt tokens were served from the "
                          "server's prefix cache although every prompt of this workload is fresh (a chat template "
                          "or a system prompt repeated in every request?): its TTFT is lower than new prompts "
                          "would see")
        if r.client_bound:
            console.print(f"[yellow]warning[/]: {r.label}: the client's own event loop lagged "
                          f"{r.loop_lag_p99_ms:.0f} ms (p99); the client, not the server, may be the bottleneck — "
                          "run brisk bench on another machine or lower the concurrency")
        for error, count in list(r.summary.errors.items())[:5]:
            console.print(f"[red]{r.label}: {count} failed[/]: {error}")
