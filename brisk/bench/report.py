"""`brisk bench` output: a rich table, JSON close to vLLM's benchmark result, CSV, PNG plots."""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from brisk.fileio import output_dir, output_path, write_output
from brisk.bench.metrics import RequestRecord, Summary
from brisk.plotting import integer_ticks, legend_below, pyplot, save_png

SCHEMA_VERSION = 1
LAG_WARNING_MS = 20.0


@dataclass
class RunResult:
    label: str  # e.g. "concurrency=16"
    knob: str  # "concurrency" | "rate" | "replay"
    value: float | None
    records: list[RequestRecord]
    summary: Summary
    loop_lag_p99_ms: float
    max_concurrency: int | None = None

    @property
    def client_bound(self) -> bool:
        return self.loop_lag_p99_ms > LAG_WARNING_MS

    def to_dict(self) -> dict[str, Any]:
        ok = [r for r in self.records if r.ok]
        out = {"label": self.label, self.knob: self.value,
               **self.summary.to_dict()}
        for name in ("ttft", "tpot", "itl", "e2el"):
            values = {"ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok],
                      "itl": [g for r in ok for g in r.itl_s], "e2el": [r.e2e_s for r in ok]}[name]
            values = [v for v in values if v is not None]
            out[f"std_{name}_ms"] = float(np.std(values) * 1e3) if values else None
        start = min(r.sent_ts for r in self.records)
        out.update({
            "send_offsets": [round(r.sent_ts - start, 6) for r in self.records],
            "input_lens": [r.prompt_tokens for r in self.records],
            "output_lens": [r.output_tokens for r in self.records],
            "ttfts": [r.ttft_s for r in self.records],
            "itls": [r.itl_s for r in self.records],
            "e2els": [r.e2e_s for r in self.records],
            "errors": [r.error for r in self.records],
            "server_timings": [r.server_timings for r in self.records],
            "client": {"loop_lag_p99_ms": self.loop_lag_p99_ms, "client_bound": self.client_bound},
        })
        return out


COLUMNS = ("run", "ok/failed", "out tok/s", "req/s", "goodput", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
           "ITL p50 ms", "ITL p99 ms", "E2E p50 ms", "cache hits")
WIDE_TABLE_COLUMNS = 140  # the run-per-row table needs about this many; narrower terminals get a run per column


def _cells(r: RunResult) -> list[str]:
    s = r.summary

    def ms(dist, attr):
        return "–" if dist is None else f"{getattr(dist, attr) * 1e3:.0f}"

    return [r.label + (" ⚠" if r.client_bound else ""), f"{s.completed}/{s.failed}", f"{s.output_throughput:.1f}",
            f"{s.request_throughput:.2f}", "–" if s.goodput is None else f"{s.goodput:.2f}", ms(s.ttft, "median"),
            ms(s.ttft, "p99"), ms(s.tpot, "median"), ms(s.itl, "median"), ms(s.itl, "p99"), ms(s.e2el, "median"),
            _cache_hits(s)]


def _cache_hits(s) -> str:
    """The prefix cache's share of the prompt tokens, and (brisk with --kv-cache-host-bytes or --kv-cache-dir) the
    host and disk tiers' parts of it."""
    if s.prefix_cache_hit_rate is None:
        return "–"
    parts = [f"{rate:.0%} {tier}" for tier, rate in (("host", s.host_hit_rate), ("disk", s.disk_hit_rate)) if rate]
    return f"{s.prefix_cache_hit_rate:.0%}" + (f" ({', '.join(parts)})" if parts else "")


def console_table(results: list[RunResult], width: int | None = None):
    """The results as a rich table: a run per row where the terminal is wide enough, else a run per column (the
    metrics down the side), so that an 80-column terminal shows every figure whole."""
    from rich.table import Table

    table = Table(title="brisk bench", header_style="bold")
    if width is None or width >= WIDE_TABLE_COLUMNS:
        for col in COLUMNS:
            table.add_column(col, justify="right")
        for r in results:
            table.add_row(*_cells(r))
        return table
    rows = [_cells(r) for r in results]
    table.add_column("metric", no_wrap=True)
    for cells in rows:
        table.add_column(cells[0], justify="right", overflow="fold")
    for i, name in enumerate(COLUMNS[1:], start=1):
        table.add_row(name, *(cells[i] for cells in rows))
    return table


def write_json(path: Path, meta: dict[str, Any], results: list[RunResult], result_format: str = "brisk") -> list[Path]:
    if result_format == "vllm":
        return write_vllm(Path(path), meta, results)
    doc = {"brisk_bench_schema": SCHEMA_VERSION, **meta, "runs": [r.to_dict() for r in results]}
    return [write_output(path, json.dumps(doc, indent=1, default=float) + "\n", "--json")]


# The keys of `vllm bench serve --save-result` (vLLM main, vllm/benchmarks/serve.py, late 2026), in
# its order, for a generation backend with the default --percentile-metrics ttft,tpot,itl and
# --metric-percentiles 99, without --save-detailed.
VLLM_HEADER_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                    "request_rate", "burstiness", "max_concurrency")
VLLM_RESULT_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                    "latencies", "queue_times", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx")
VLLM_METRICS = ("ttft", "tpot", "itl")


def vllm_result(meta: dict[str, Any], r: RunResult) -> dict[str, Any]:
    s = r.summary
    ok = [x for x in r.records if x.ok]
    doc: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "endpoint_type": _vllm_backend(meta), "backend": _vllm_backend(meta),
        "label": None, "model_id": meta["model_id"], "tokenizer_id": meta["model_id"],
        "num_prompts": len(r.records),
        "request_rate": r.value if r.knob == "rate" else "inf",
        "burstiness": meta["burstiness"], "max_concurrency": r.max_concurrency,
        "duration": s.duration_s, "completed": s.completed, "failed": s.failed,
        "total_input_tokens": s.total_input_tokens, "total_output_tokens": s.total_output_tokens,
        "request_throughput": s.request_throughput, "request_goodput": s.goodput,
        "output_throughput": s.output_throughput, "total_token_throughput": s.total_token_throughput,
        "latencies": [x.e2e_s or 0.0 for x in r.records],
        "queue_times": [max(x.sent_ts - x.due_ts, 0.0) if x.due_ts is not None else 0.0 for x in r.records],
        **_peaks(r.records), "rtfx": 0.0,
    }
    for name in VLLM_METRICS:
        values = {"ttft": [x.ttft_s for x in ok], "tpot": [x.tpot_s for x in ok],
                  "itl": [g for x in ok for g in x.itl_s]}[name]
        arr = np.asarray([v for v in values if v is not None] or [0.0]) * 1e3  # vLLM reports 0 when empty
        doc[f"mean_{name}_ms"], doc[f"median_{name}_ms"] = float(arr.mean()), float(np.median(arr))
        doc[f"std_{name}_ms"], doc[f"p99_{name}_ms"] = float(arr.std()), float(np.percentile(arr, 99))
    return doc


def _vllm_backend(meta: dict[str, Any]) -> str:
    return "openai-chat" if meta.get("endpoint") == "chat" else "openai"


def _peaks(records: list[RequestRecord]) -> dict[str, float]:
    """vLLM's peak figures: output tokens in the busiest whole second, and the most requests in
    flight during any second (a request counts in every second it overlaps)."""
    if not records:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    start = min(x.sent_ts for x in records)
    tokens: dict[int, int] = {}
    active: dict[int, int] = {}
    for x in records:
        for t in x.chunk_ts:
            tokens[int(t - start)] = tokens.get(int(t - start), 0) + 1
        end = x.end_ts if x.end_ts is not None else (x.chunk_ts[-1] if x.chunk_ts else x.sent_ts)
        for second in range(int(x.sent_ts - start), int(end - start) + 1):
            active[second] = active.get(second, 0) + 1
    return {"max_output_tokens_per_s": float(max(tokens.values(), default=0)),
            "max_concurrent_requests": max(active.values(), default=0)}


def write_vllm(path: Path, meta: dict[str, Any], results: list[RunResult]) -> list[Path]:
    written = []
    for r in results:
        target = path if len(results) == 1 else path.with_name(f"{path.stem}-{_slug(r.label)}{path.suffix}")
        written.append(write_output(target, json.dumps(vllm_result(meta, r), indent=1) + "\n", "--json"))
    return written


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in label.replace("=", "")).strip("-")


CSV_COLUMNS = ("label", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
               "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
               "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms",
               "p99_e2el_ms")


def write_csv(path: Path, results: list[RunResult]) -> None:
    with open(output_path(path, "--csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            writer.writerow({"label": r.label, **r.summary.to_dict()})


def write_plots(directory: Path, results: list[RunResult]) -> list[Path]:
    plt = pyplot()

    directory = output_dir(directory, "--plot")
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for r in results:
        ok = [x for x in r.records if x.ok]
        series = {"TTFT": [x.ttft_s for x in ok if x.ttft_s is not None],
                  "inter-token latency": [g for x in ok for g in x.itl_s],
                  "end-to-end latency": [x.e2e_s for x in ok]}
        for ax, (name, values) in zip(axes, series.items()):
            if values:
                v = np.sort(np.asarray(values) * 1e3)
                frac = np.arange(1, len(v) + 1) / len(v)
                ax.step(np.concatenate([[v[0]], v]), np.concatenate([[0.0], frac]), where="post", label=r.label)
    for ax, name in zip(axes, ("TTFT", "inter-token latency", "end-to-end latency")):
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of gaps" if name == "inter-token latency" else "fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    legend_below(fig, axes)
    written.append(save_png(fig, directory / "latency_cdf.png"))
    swept = [r for r in results if r.value is not None]
    if len({r.value for r in swept}) > 1:
        fig, ax1 = plt.subplots(figsize=(7, 4.6))
        xs = [r.value for r in swept]
        ax1.plot(xs, [r.summary.output_throughput for r in swept], "o-", label="output tokens/s (left)")
        ax1.set_xlabel(swept[0].knob + (" (requests/s)" if swept[0].knob == "rate" else " (streams)"))
        ax1.set_ylabel("output tokens/s")
        ax1.set_ylim(bottom=0)
        ax2 = ax1.twinx()
        ax2.plot(xs, [r.summary.ttft.median * 1e3 if r.summary.ttft else np.nan for r in swept], "s--", color="C3",
                 label="TTFT p50, ms (right)")
        ax2.plot(xs, [r.summary.ttft.p99 * 1e3 if r.summary.ttft else np.nan for r in swept], "^:", color="C1",
                 label="TTFT p99, ms (right)")
        ax2.set_ylabel("TTFT (ms)")
        ax2.set_ylim(bottom=0)
        if swept[0].knob == "concurrency":
            integer_ticks(ax1, xs)
        ax1.set_title(f"throughput and TTFT vs {swept[0].knob}")
        ax1.grid(alpha=0.3)
        legend_below(fig, [ax1, ax2], ncol=3)
        written.append(save_png(fig, directory / f"throughput_vs_{swept[0].knob}.png"))
    return written
