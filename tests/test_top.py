"""`brisk top`: Prometheus-style quantiles from bucket deltas, and a live view of a server."""

import subprocess
import sys
import threading

import pytest

from brisk.top import Scrape, histogram_quantile, summarize

from live_server import serve_engine
from engines import make_engine


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10 = top of the first bucket
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)  # 0.3
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.5 + 0.5 * (36 - 30) / 10)  # 0.8
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 5.0)]) == 1.0  # +Inf: highest finite bound
    assert histogram_quantile(0.5, []) is None and histogram_quantile(0.5, [(1.0, 0.0)]) is None


def scrape(ts: float, tokens: float, ttft_fast: float, ttft_all: float, queries: float, hits: float,
           stopped: float) -> Scrape:
    """A scrape with TTFT buckets le=0.1 (fast) and le=1.0 / +Inf (all)."""
    ttft = "brisk:time_to_first_token_seconds_bucket"
    return Scrape(ts, {("brisk:generation_tokens_total", ()): tokens, (ttft, (("le", "0.1"),)): ttft_fast,
                       (ttft, (("le", "1.0"),)): ttft_all, (ttft, (("le", "+Inf"),)): ttft_all,
                       ("brisk:prefix_cache_queries_total", ()): queries, ("brisk:prefix_cache_hits_total", ()): hits,
                       ("brisk:request_success_total", (("finish_reason", "stop"),)): stopped})


def test_summarize_uses_deltas_between_scrapes():
    prev = scrape(0.0, tokens=100, ttft_fast=5, ttft_all=5, queries=100, hits=0, stopped=3)
    cur = scrape(2.0, tokens=300, ttft_fast=5, ttft_all=9, queries=300, hits=50, stopped=7)
    view = summarize(prev, cur)
    assert view["generation_tokens_per_s"] == 100.0 and view["requests_per_s"] == 2.0
    # the 4 new TTFTs all fell in (0.1, 1.0]: the old 5 fast ones no longer count
    assert view["ttft_s"]["p50"] == pytest.approx(0.1 + 0.9 * 2 / 4)
    assert view["prefix_hit_rate"] == 0.25


def test_summarize_adds_replicas_up_and_takes_the_fullest_replicas_kv_usage():
    """Behind a Ray Serve ingress each engine series carries a `replica` label."""
    def replicas(ts, queries, hits, running):
        rows = {}
        for rid, q, h, r, usage in (("a", queries[0], hits[0], running[0], 0.2), ("b", queries[1], hits[1],
                                                                                  running[1], 0.7)):
            lbl = (("replica", rid),)
            rows.update({("brisk:prefix_cache_queries_total", lbl): q, ("brisk:prefix_cache_hits_total", lbl): h,
                         ("brisk:num_requests_running", lbl): r, ("brisk:kv_usage_ratio", lbl): usage})
        return Scrape(ts, rows)

    view = summarize(replicas(0.0, (100, 0), (0, 0), (0, 0)), replicas(1.0, (300, 200), (150, 50), (3, 4)))
    assert view["running"] == 7
    assert view["prefix_hit_rate"] == pytest.approx(200 / 400)
    assert view["kv_usage"] == 0.7


def test_top_once_against_a_live_server(demo):
    with serve_engine(make_engine(demo)) as live:
        def load():
            with live.client() as http:
                for _ in range(3):
                    http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 16, "ignore_eos": True})

        worker = threading.Thread(target=load)
        worker.start()
        out = subprocess.run([sys.executable, "-m", "brisk", "top", live.url, "--once", "--interval", "3"],
                             capture_output=True, text=True, timeout=120)
        worker.join(timeout=60)
    assert out.returncode == 0, out.stderr
    for needle in ("brisk top", "throughput", "tok/s", "TTFT", "KV cache", "context guard"):
        assert needle in out.stdout


def test_top_unreachable_is_one_line():
    out = subprocess.run([sys.executable, "-m", "brisk", "top", "http://127.0.0.1:9", "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot reach" in out.stderr and "Traceback" not in out.stderr


def test_top_without_a_terminal_says_to_use_once():
    """A live-redrawing table in a log or a pipe is garbage: without a TTY, top asks for --once."""
    out = subprocess.run([sys.executable, "-m", "brisk", "top", "http://127.0.0.1:9"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--once" in out.stderr and "terminal" in out.stderr
