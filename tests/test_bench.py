"""`brisk bench`: metric math on hand-made timestamps, workload pieces, and an e2e run against
`brisk serve` whose numbers are checked against the server's own counters."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from brisk.bench.metrics import SLO, RequestRecord, all_decoding_window, summarize
from brisk.bench.workloads import GroupTexts, arrival_offsets, parse_length_dist, replay, PromptMaker
from brisk.errors import BriskError

from live_server import serve_engine
from engines import make_engine


def records():
    # request a: sent 0, chunks at 0.5, 0.6, 0.8, end 0.8, 4 tokens (the last chunk carried 2)
    a = RequestRecord(sent_ts=0.0, chunk_ts=[0.5, 0.6, 0.8], end_ts=0.8, prompt_tokens=10, output_tokens=4)
    # request b: sent 1.0, chunks at 1.2, 1.5, end 1.5, 2 tokens
    b = RequestRecord(sent_ts=1.0, chunk_ts=[1.2, 1.5], end_ts=1.5, prompt_tokens=20, output_tokens=2)
    # request c failed
    c = RequestRecord(sent_ts=0.2, error="HTTP 500: boom", status=500)
    return a, b, c


def test_metric_math_by_hand():
    a, b, c = records()
    assert a.ttft_s == pytest.approx(0.5) and b.ttft_s == pytest.approx(0.2)
    assert a.tpot_s == pytest.approx((0.8 - 0.5) / 3) and b.tpot_s == pytest.approx(0.3)
    s = summarize([a, b, c])
    assert (s.completed, s.failed, s.errors) == (2, 1, {"HTTP 500: boom": 1})
    assert s.duration_s == pytest.approx(1.5)
    assert s.total_input_tokens == 30 and s.total_output_tokens == 6
    assert s.output_throughput == pytest.approx(6 / 1.5) and s.request_throughput == pytest.approx(2 / 1.5)
    # ITL pools the gaps of all requests: 0.1, 0.2 (a) and 0.3 (b)
    assert s.itl.mean == pytest.approx(0.2) and s.itl.median == pytest.approx(0.2) and s.itl.count == 3
    assert s.ttft.mean == pytest.approx(0.35) and s.ttft.p99 == pytest.approx(0.2 + 0.99 * 0.3)
    assert s.e2el.median == pytest.approx((0.8 + 0.5) / 2)


def test_the_result_table_is_readable_at_80_columns():
    """A run per column on a narrow terminal: every header and figure whole (a run per row, squeezed into 80
    columns, cut each one to `con…`, `11…`, `TT…`)."""
    from rich.console import Console

    from brisk.bench.report import COLUMNS, RunResult, console_table

    a, b, c = records()
    runs = [RunResult(f"concurrency={n}", "concurrency", n, [a, b, c], summarize([a, b, c]), 1.0) for n in (1, 16, 64)]
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(console_table(runs, console.width))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    for header in [*COLUMNS[1:], "concurrency=16", "concurrency=64"]:
        assert header in text, header
    assert "497" in text and "1.33" in text  # the TTFT p99 in ms and req/s, whole
    wide = Console(width=200, record=True, file=open("/dev/null", "w"))
    wide.print(console_table(runs, wide.width))
    text = wide.export_text()
    assert "…" not in text and "TTFT p50 ms" in text


def test_the_tiers_parts_of_the_cache_hits_are_reported():
    """brisk's usage.brisk.cached_prompt_tokens_by_tier: the host and disk tiers' parts of the prefix-cache hits, in
    the summary and in the table's cache column; absent (a peer, or a reply without it), nothing is claimed."""
    from brisk.bench.report import _cache_hits

    def record(cached, disk):
        timings = None if disk is None else {"cached_prompt_tokens_by_tier": {"memory": cached - disk, "disk": disk}}
        return RequestRecord(sent_ts=0.0, chunk_ts=[0.5], end_ts=0.6, prompt_tokens=100, output_tokens=1,
                             cached_tokens=cached, server_timings=timings)

    s = summarize([record(80, 60), record(40, 0)])
    assert (s.cached_input_tokens, s.disk_cached_input_tokens) == (120, 60)
    assert _cache_hits(s) == "60% (30% disk)" and s.to_dict()["disk_hit_rate"] == 0.3
    peer = summarize([record(80, None), record(40, 0)])
    assert peer.disk_cached_input_tokens is None and _cache_hits(peer) == "60%"

    def with_host(cached, host, disk):
        r = record(cached, disk)
        r.server_timings["cached_prompt_tokens_by_tier"] = {"memory": cached - host - disk, "host": host, "disk": disk}
        return r

    s = summarize([with_host(80, 20, 40), with_host(40, 10, 0)])
    assert (s.host_cached_input_tokens, s.disk_cached_input_tokens) == (30, 40)
    assert _cache_hits(s) == "60% (15% host, 20% disk)" and s.to_dict()["host_hit_rate"] == 0.15
    # a reply from before the host tier (no "host" key) found nothing there
    assert summarize([record(80, 60)]).host_cached_input_tokens == 0


def test_goodput_counts_requests_meeting_every_slo():
    a, b, c = records()
    assert summarize([a, b, c], SLO(ttft_ms=300)).goodput == pytest.approx(1 / 1.5)  # only b
    assert summarize([a, b, c], SLO(ttft_ms=600, tpot_ms=200)).goodput == pytest.approx(1 / 1.5)  # b's tpot 300
    assert summarize([a, b, c], SLO(e2el_ms=900)).goodput == pytest.approx(2 / 1.5)


def test_all_decoding_window_counts_chunks_while_every_request_decodes():
    # x starts decoding at 1.0 and ends at 3.0; y's first chunk is at 1.5 (its prompt ran until then)
    x = RequestRecord(sent_ts=0.0, chunk_ts=[1.0, 1.4, 1.6, 1.8, 2.0, 3.0], end_ts=3.0, output_tokens=6)
    y = RequestRecord(sent_ts=0.0, chunk_ts=[1.5, 1.7, 1.9, 2.1, 2.5], end_ts=2.5, output_tokens=5)
    w = all_decoding_window([x, y])
    # window (1.5, 2.5]: x's 1.6, 1.8, 2.0 and y's 1.7, 1.9, 2.1, 2.5 (y's first chunk opens it)
    assert (w.seconds, w.chunks) == (pytest.approx(1.0), 7) and w.tokens_per_s == pytest.approx(7.0)
    # more requests than streams: the last started after the first ended; no such window
    z = RequestRecord(sent_ts=3.1, chunk_ts=[3.5, 3.6], end_ts=3.6, output_tokens=2)
    assert all_decoding_window([x, y, z]) is None
    assert all_decoding_window([x, y, records()[2]]) is None  # a failed request: no figure


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert parse_length_dist("128", "x").sample(rng, 3) == [128, 128, 128]
    u = parse_length_dist("uniform:10-20", "x").sample(rng, 500)
    assert min(u) >= 10 and max(u) <= 20 and len(set(u)) == 11
    ln = parse_length_dist("lognormal:mean=300,sigma=0.8,min=16,max=1000", "x").sample(rng, 4000)
    assert 16 <= min(ln) and max(ln) <= 1000 and 200 < np.mean(ln) < 330  # truncation pulls the mean down
    for bad in ("", "fixed:0", "uniform:9-3", "lognormal:mean=5", "gamma:1", "normal:mean=1,std=-1"):
        with pytest.raises(BriskError, match="length distribution"):
            parse_length_dist(bad, "--input-len")


def test_poisson_arrivals_have_the_requested_rate():
    gaps = np.diff(arrival_offsets(4000, rate=5.0, burstiness=1.0, rng=np.random.default_rng(1)))
    assert np.mean(gaps) == pytest.approx(0.2, rel=0.05) and np.std(gaps) == pytest.approx(0.2, rel=0.1)
    regular = np.diff(arrival_offsets(4000, rate=5.0, burstiness=50.0, rng=np.random.default_rng(1)))
    assert np.std(regular) < 0.05


def test_replay_trace_parsing(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 10.5, "input_tokens": 5, "output_tokens": 3}\n\n'
                     '{"arrival_s": 12, "prompt_tokens": 7, "output_tokens": 1}\n'
                     '{"arrival_s": 13, "prompt_tokens": 7, "output_tokens": null, "finish_reason": "abort"}\n'
                     '{"arrival_s": 14, "prompt_tokens": 9, "output_tokens": 2, "finish_reason": "timeout"}\n')
    reqs, arrivals, note = replay(trace, PromptMaker(np.random.default_rng(0)), None, {})
    # the abort with no output is skipped; the timeout that produced 2 tokens is replayed with them
    assert arrivals == [0.0, 1.5, 3.5] and [r.max_tokens for r in reqs] == [3, 1, 2]
    assert len(reqs[1].prompt.split()) == 7
    assert "1 ended early" in note and "1 ended before any output" in note
    trace.write_text('{"timestamp": 1}\n')
    with pytest.raises(BriskError, match=":1: need prompt_tokens"):
        replay(trace, PromptMaker(np.random.default_rng(0)), None, {})


def test_replay_keeps_the_traces_prefix_groups_the_same_in_every_replay(tmp_path, demo):
    """A trace's prefix_group/prefix_tokens: every request of a group starts with the same text of exactly that many
    tokens (the demo tokenizer counting), a later turn with a longer prefix continues it, another group's text
    differs, and a second replay (another random draw, as after a restart) sends the same prefixes with new
    suffixes; `--endpoint chat` sends the replay as chats."""
    from types import SimpleNamespace

    from brisk.bench.command import build_workload

    def count(text):
        return len(demo.tokenizer.encode(text))

    rows = [{"arrival_s": 0, "prompt_tokens": 60, "output_tokens": 4, "prefix_group": "alice", "prefix_tokens": 50},
            {"arrival_s": 1, "prompt_tokens": 60, "output_tokens": 4, "prefix_group": "bob", "prefix_tokens": 50},
            {"arrival_s": 2, "prompt_tokens": 100, "output_tokens": 4, "prefix_group": "alice", "prefix_tokens": 80},
            {"arrival_s": 3, "prompt_tokens": 40, "output_tokens": 4, "prefix_group": "bob", "prefix_tokens": 40},
            {"arrival_s": 4, "prompt_tokens": 30, "output_tokens": 4}]
    trace = tmp_path / "chats.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, _, _ = replay(trace, PromptMaker(np.random.default_rng(1), count), None, {})
    again, _, _ = replay(trace, PromptMaker(np.random.default_rng(2), count), None, {})
    a1, b1, a2, b2, plain = (r.prompt for r in first)
    assert [count(p) for p in (a1, b1, a2, b2, plain)] == [60, 60, 100, 40, 30]
    alice50 = GroupTexts(count).prefix("alice", 50)
    assert count(alice50) == 50 and a1.startswith(alice50 + " ") and a2.startswith(alice50 + " ")
    assert not b1.startswith(alice50[:40])
    ids = [demo.tokenizer.encode(p) for p in (a1, a2, b1, b2)]
    assert ids[0][:49] == ids[1][:49] and ids[2][:39] == ids[3][:39]  # the groups' leading tokens
    assert ids[0][:5] != ids[2][:5]
    for old, new in zip(first, again):  # the same prefixes in another replay, fresh suffixes
        assert count(old.prompt) == count(new.prompt)
    assert demo.tokenizer.encode(again[0].prompt)[:49] == ids[0][:49] and again[0].prompt != a1
    assert again[3].prompt == b2  # all of it is bob's prefix
    assert again[4].prompt != plain

    args = SimpleNamespace(seed=0, no_ignore_eos=False, output_len="8", workload="replay", trace=trace,
                           endpoint="chat")
    reqs, arrivals = build_workload(args, SimpleNamespace(counter=count), "m", 5)
    assert arrivals == [0, 1, 2, 3, 4] and all(r.prompt is None and r.messages[0]["role"] == "user" for r in reqs)


def counter(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    return 0.0


@pytest.fixture(scope="module")
def server(demo):
    with serve_engine(make_engine(demo)) as live:
        yield live


def test_bench_e2e_agrees_with_the_server(server, tmp_path):
    with server.client() as http:
        before = http.get("/metrics").text
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "bench", server.url, "--concurrency", "3",
                           "--num-requests", "6", "--warmup", "0", "--input-len", "uniform:20-60", "--output-len",
                           "8", "--json", str(out), "--csv", str(tmp_path / "b.csv")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with server.client() as http:
        after = http.get("/metrics").text
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    assert doc["model_id"] == "smollm2-135m-instruct" and doc["exact_prompt_lengths"] is True
    assert run["completed"] == 6 and run["failed"] == 0 and run["concurrency"] == 3
    assert run["output_lens"] == [8] * 6
    # token counts equal the server's own counters over the run
    assert run["total_output_tokens"] == counter(after, "brisk:generation_tokens_total") - \
        counter(before, "brisk:generation_tokens_total")
    assert run["total_input_tokens"] == counter(after, "brisk:prompt_tokens_total") - \
        counter(before, "brisk:prompt_tokens_total")
    assert all(20 <= n <= 60 for n in run["input_lens"])  # /tokenize made the lengths exact
    # percentiles agree with the per-request data in the same file
    ttfts = np.array(run["ttfts"]) * 1e3
    assert run["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert run["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    itls = np.array([g for per in run["itls"] for g in per]) * 1e3
    assert len(itls) == 6 * 7 and run["mean_itl_ms"] == pytest.approx(itls.mean())
    assert all(t["ttft_ms"] > 0 for t in run["server_timings"])  # brisk's own phase timings came along
    assert "concurrency=3" in (tmp_path / "b.csv").read_text()


def test_bench_rate_mode_and_failures_are_reported(server, tmp_path):
    out = tmp_path / "rate.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "bench", server.url, "--request-rate", "20",
                           "--num-requests", "4", "--warmup", "0", "--input-len", "16", "--output-len", "4000",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    # 4000 output tokens exceed the 1024 window: every request fails with the server's reason
    assert proc.returncode == 2 and "every request failed" in proc.stderr
    assert "context length" in proc.stderr.lower() or "maximum context length" in proc.stderr


def test_bench_unreachable_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "brisk", "bench", "http://127.0.0.1:9"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "cannot reach" in proc.stderr and "Traceback" not in proc.stderr


def test_sharegpt_and_shared_prefix_workloads(tmp_path):
    from brisk.bench.workloads import shared_prefix, sharegpt

    data = [{"conversations": [{"from": "human", "value": "What is a river?"},
                               {"from": "gpt", "value": "A river is a natural stream of water."}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"id": "no conversations at all"}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt(path, np.random.default_rng(0), 3, None, 100, {"temperature": 0})
    assert [r.messages[0]["content"] for r in reqs] == ["What is a river?"] * 3  # the usable one, cycled
    assert reqs[0].max_tokens == 8  # the reply's length (words, without a tokenizer)
    path.write_text("[]")
    with pytest.raises(BriskError, match="no conversations"):
        sharegpt(path, np.random.default_rng(0), 1, None, 100, {})

    maker = PromptMaker(np.random.default_rng(1))
    reqs = shared_prefix(maker, np.random.default_rng(2), 6, 2, 30, parse_length_dist("5", "x"),
                         parse_length_dist("4", "x"), {})
    heads = [" ".join(r.prompt.split()[:30]) for r in reqs]
    assert heads[0] == heads[2] == heads[4] and heads[1] == heads[3] == heads[5] and heads[0] != heads[1]
    assert all(len(r.prompt.split()) == 35 for r in reqs)


def test_bench_rate_and_replay_modes(server, tmp_path):
    out = tmp_path / "rate.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "bench", server.url, "--request-rate", "8",
                           "--num-requests", "6", "--warmup", "0", "--input-len", "16", "--output-len", "4",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 6 and run["rate"] == 8
    offsets = run["send_offsets"]
    assert offsets == sorted(offsets) and offsets[-1] > 0.1  # Poisson arrivals, not all at once
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_tokens": 20, "output_tokens": n}) + "\n"
                             for t, n in ((0.0, 3), (0.5, 5), (0.6, 2))))
    out = tmp_path / "replay.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "bench", server.url, "--workload", "replay", "--trace",
                           str(trace), "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert run["output_lens"] == [3, 5, 2] and run["input_lens"] == [20, 20, 20]
    assert run["send_offsets"][1] >= 0.45  # sent at the trace's own times


def test_sweep_levels_get_fresh_prompts(server, tmp_path):
    """Each level of a sweep sends prompts of its own: the prefix cache must not serve level 2
    from level 1's prompts (it used to: TTFT fell as the load rose)."""
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "bench", server.url, "--sweep", "concurrency=1,2",
                           "--num-requests", "3", "--warmup", "1", "--input-len", "64", "--output-len", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["concurrency=1", "concurrency=2"]
    for run in runs:
        assert run["completed"] == 3 and run["cached_input_tokens"] is not None
        assert run["prefix_cache_hit_rate"] < 0.2, run["prefix_cache_hit_rate"]
    assert "served from the server's prefix cache" not in proc.stderr
    # no terminal here: plain progress lines, not a redrawn bar
    assert "concurrency=1: 3/3 (100%)" in proc.stderr and "concurrency=2: 3/3 (100%)" in proc.stderr


def test_shared_prefix_runs_share_prefixes_and_report_hits(server, tmp_path):
    out = tmp_path / "shared.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "bench", server.url, "--workload", "shared-prefix",
                           "--num-prefixes", "1", "--prefix-len", "64", "--input-len", "8", "--output-len", "2",
                           "--concurrency", "1", "--num-requests", "3", "--warmup", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert run["prefix_cache_hit_rate"] > 0.5  # the warm-up cached the shared prefix


def test_vllm_result_format_has_vllms_keys(server, tmp_path):
    from brisk.bench.report import VLLM_HEADER_KEYS, VLLM_METRICS, VLLM_RESULT_KEYS

    out = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "bench", server.url, "--concurrency", "2",
                           "--num-requests", "3", "--warmup", "0", "--input-len", "16", "--output-len", "4",
                           "--json", str(out), "--result-format", "vllm"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    expected = list(VLLM_HEADER_KEYS) + list(VLLM_RESULT_KEYS) + [
        f"{stat}_{m}_ms" for m in VLLM_METRICS for stat in ("mean", "median", "std", "p99")]
    assert list(doc) == expected
    # the fixed list is vLLM's (vllm/benchmarks/serve.py): a dashboard reading these keys finds them
    assert {"duration", "completed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_itl_ms",
            "mean_tpot_ms", "max_concurrency", "request_rate"} <= set(doc)
    assert doc["completed"] == 3 and doc["total_output_tokens"] == 12 and doc["max_concurrency"] == 2
    assert doc["request_rate"] == "inf" and doc["backend"] == "openai" and len(doc["latencies"]) == 3
    assert doc["median_ttft_ms"] > 0 and doc["max_concurrent_requests"] >= 1


def test_trace_round_trip_serve_bench_kvplan_with_an_aborted_request(demo, tmp_path):
    """serve --request-log -> bench --workload replay -> kv-plan --trace, one trace schema, with a
    request the client abandoned mid-stream in the log."""
    log = tmp_path / "requests.jsonl"
    with serve_engine(make_engine(demo), request_log=str(log)) as live, live.client() as http:
        for n in (3, 5):
            assert http.post("/v1/completions", json={"prompt": "the sea and the sky " * 4, "max_tokens": n,
                                                      "ignore_eos": True}).status_code == 200
        with http.stream("POST", "/v1/completions", json={"prompt": "a long story", "max_tokens": 400,
                                                          "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    break  # leave after the first event: the server aborts the request
        deadline = time.monotonic() + 30
        while len(log.read_text().splitlines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(rows) == 3 and all(r["trace_version"] == 1 for r in rows)
        aborted = rows[2]
        assert aborted["finish_reason"] == "client_disconnect" and aborted["max_tokens"] == 400
        assert aborted["output_tokens"] is not None and aborted["output_tokens"] < 400
        out = tmp_path / "replay.json"
        proc = subprocess.run([sys.executable, "-m", "brisk", "bench", live.url, "--workload", "replay",
                               "--trace", str(log), "--json", str(out)], capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    kept = [r for r in rows if r["output_tokens"]]
    assert run["output_lens"] == [r["output_tokens"] for r in kept]
    assert run["input_lens"] == [r["prompt_tokens"] for r in kept]
    plan = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "kv-plan", "--trace", str(log), "--memory", "256MiB",
                           "--max-model-len", "1024", "--block-sizes", "16", "--json", str(plan)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(plan.read_text())
    logged = [json.loads(line) for line in log.read_text().splitlines()]  # the replay was logged too
    assert doc["requests"] + doc["skipped_lines"] == len(logged) == 3 + len(kept)
    assert doc["aborted_requests"] == (1 if aborted["output_tokens"] else 0)
