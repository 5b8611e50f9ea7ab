"""`brisk top URL`: a live terminal view of a running brisk server, from its /metrics.

Rates and latency percentiles come from the difference between two scrapes (histogram
buckets interpolated as Prometheus' histogram_quantile does), so the view shows the last
interval, not the server's lifetime. No Prometheus needed.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from brisk.errors import BriskError


@dataclass
class Scrape:
    ts: float
    samples: dict[tuple[str, tuple], float]

    def get(self, name: str, **labels) -> float:
        """The sum over every series of `name` carrying `labels` (behind a Ray Serve ingress each
        engine series carries a `replica` label: the sum is the whole deployment's)."""
        want = labels.items()
        return sum(v for (n, lbl), v in self.samples.items() if n == name and want <= dict(lbl).items())

    def max(self, name: str) -> float:
        """The largest value of a ratio over its series (the fullest replica's KV usage)."""
        return max((v for (n, _), v in self.samples.items() if n == name), default=0.0)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(k[1])[label]: v for k, v in self.samples.items() if k[0] == name and label in dict(k[1])}

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """[(upper bound, cumulative count)] sorted by bound, summed over other labels."""
        out: dict[float, float] = {}
        for (name, labels), v in self.samples.items():
            if name == f"{histogram}_bucket":
                le = float(dict(labels)["le"])
                out[le] = out.get(le, 0.0) + v
        return sorted(out.items())


def scrape(client: httpx.Client, url: str) -> Scrape:
    try:
        resp = client.get(f"{url.rstrip('/')}/metrics")
    except httpx.HTTPError as e:
        raise BriskError(f"cannot reach {url}/metrics ({type(e).__name__}: {e}); is the server running?") from None
    if resp.status_code != 200:
        raise BriskError(f"{url}/metrics answered HTTP {resp.status_code}; brisk top needs a brisk server")
    samples = {}
    try:
        for family in text_string_to_metric_families(resp.text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    except ValueError as e:
        raise BriskError(f"{url}/metrics is not Prometheus text ({e})") from None
    if not any(name.startswith("brisk:") for name, _ in samples):
        raise BriskError(f"{url}/metrics has no brisk:* metrics; brisk top reads brisk servers "
                         "(use brisk doctor for other engines)")
    return Scrape(time.monotonic(), samples)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate from cumulative buckets: linear within the bucket holding rank q."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # the highest finite bound, like Prometheus
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _delta_buckets(prev: Scrape, cur: Scrape, histogram: str) -> list[tuple[float, float]]:
    before = dict(prev.buckets(histogram))
    return [(le, count - before.get(le, 0.0)) for le, count in cur.buckets(histogram)]


def summarize(prev: Scrape, cur: Scrape) -> dict[str, Any]:
    dt = max(cur.ts - prev.ts, 1e-9)

    def rate(name: str, **labels) -> float:
        return max(cur.get(name, **labels) - prev.get(name, **labels), 0.0) / dt

    def quantiles(histogram: str) -> dict[str, float | None]:
        deltas = _delta_buckets(prev, cur, histogram)
        return {f"p{int(q * 100)}": histogram_quantile(q, deltas) for q in (0.5, 0.99)}

    queries = cur.get("brisk:prefix_cache_queries_total") - prev.get("brisk:prefix_cache_queries_total")
    hits = cur.get("brisk:prefix_cache_hits_total") - prev.get("brisk:prefix_cache_hits_total")
    guard = {k: v - prev.by_label("brisk:context_guard_total", "outcome").get(k, 0.0)
             for k, v in cur.by_label("brisk:context_guard_total", "outcome").items()}
    statuses = {k: v - prev.by_label("brisk:http_responses_total", "status").get(k, 0.0)
                for k, v in cur.by_label("brisk:http_responses_total", "status").items()}
    finished_before = prev.by_label("brisk:request_success_total", "finish_reason")
    finished = sum(v - finished_before.get(k, 0.0)
                   for k, v in cur.by_label("brisk:request_success_total", "finish_reason").items())
    return {
        "interval_s": dt,
        "requests_per_s": finished / dt,
        "generation_tokens_per_s": rate("brisk:generation_tokens_total"),
        "prompt_tokens_per_s": rate("brisk:prompt_tokens_total"),
        "ttft_s": quantiles("brisk:time_to_first_token_seconds"),
        "itl_s": quantiles("brisk:inter_token_latency_seconds"),
        "e2e_s": quantiles("brisk:e2e_request_latency_seconds"),
        "queue_s": quantiles("brisk:request_queue_time_seconds"),
        "running": cur.get("brisk:num_requests_running"),
        "waiting": cur.get("brisk:num_requests_waiting"),
        "kv_usage": cur.max("brisk:kv_usage_ratio"),
        "kv_blocks_used": cur.get("brisk:kv_blocks_used"),
        "kv_num_blocks": cur.get("brisk:kv_num_blocks"),
        "kv_fragmentation": cur.max("brisk:kv_fragmentation_ratio"),
        "prefix_hit_rate": hits / queries if queries > 0 else None,
        "preemptions_per_s": rate("brisk:num_preemptions_total"),
        "context_guard": {k: v for k, v in guard.items() if v},
        "http_errors": {k: v for k, v in statuses.items() if v and not k.startswith("2")},
        "load_state": next((k for k, v in cur.by_label("brisk:model_load_state", "state").items() if v == 1), "?"),
    }


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f} ms"


def render(url: str, view: dict[str, Any]):
    from rich.table import Table

    table = Table(title=f"brisk top — {url} (last {view['interval_s']:.1f} s, model {view['load_state']})",
                  show_header=True, header_style="bold")
    table.add_column("area")
    table.add_column("now", justify="right")
    table.add_column("detail")
    table.add_row("throughput", f"{view['generation_tokens_per_s']:.1f} tok/s",
                  f"{view['requests_per_s']:.2f} req/s, prompt {view['prompt_tokens_per_s']:.0f} tok/s")
    table.add_row("TTFT", f"p50 {_ms(view['ttft_s']['p50'])}", f"p99 {_ms(view['ttft_s']['p99'])}")
    table.add_row("inter-token", f"p50 {_ms(view['itl_s']['p50'])}", f"p99 {_ms(view['itl_s']['p99'])}")
    table.add_row("queue time", f"p50 {_ms(view['queue_s']['p50'])}", f"e2e p50 {_ms(view['e2e_s']['p50'])}")
    table.add_row("requests", f"{view['running']:.0f} running", f"{view['waiting']:.0f} waiting")
    table.add_row("KV cache", f"{view['kv_usage']:.0%} used",
                  f"{view['kv_blocks_used']:.0f}/{view['kv_num_blocks']:.0f} blocks, "
                  f"fragmentation {view['kv_fragmentation']:.0%}, preemptions {view['preemptions_per_s']:.2f}/s")
    hit = view["prefix_hit_rate"]
    table.add_row("prefix cache", "–" if hit is None else f"{hit:.0%} hit", "share of prompt tokens reused")
    guard = ", ".join(f"{k} {v:.0f}" for k, v in sorted(view["context_guard"].items())) or "none"
    table.add_row("context guard", "", guard)
    errors = ", ".join(f"HTTP {k}: {v:.0f}" for k, v in sorted(view["http_errors"].items())) or "none"
    table.add_row("errors", "", errors)
    return table


def run_top(url: str, interval_s: float = 2.0, once: bool = False) -> int:
    from rich.console import Console
    from rich.live import Live

    if interval_s <= 0:
        raise BriskError(f"--interval must be > 0 seconds, got {interval_s}")
    console = Console()
    if not once and not sys.stdout.isatty():
        raise BriskError("brisk top redraws a live table and needs a terminal; for a plain snapshot in a log or "
                         "a pipe, use --once")
    with httpx.Client(timeout=10) as client:
        prev = scrape(client, url)
        if once:
            time.sleep(interval_s)
            console.print(render(url, summarize(prev, scrape(client, url))))
            return 0
        with Live(console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                cur = scrape(client, url)
                live.update(render(url, summarize(prev, cur)), refresh=True)
                prev = cur
