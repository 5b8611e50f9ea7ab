"""`brisk bench`: metric math on hand-made timestamps, workload pieces, and an e2e run against
`brisk serve` whose numbers are checked against the server's own counters."""

import json
import subprocess
import sys

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from brisk.bench.metrics import SLO, RequestRecord, summarize
from brisk.bench.workloads import arrival_offsets, parse_length_dist, replay, PromptMaker
from brisk.errors import BriskError

from live_server import serve_engine
from test_engine_batching import make_engine


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


def test_goodput_counts_requests_meeting_every_slo():
    a, b, c = records()
    assert summarize([a, b, c], SLO(ttft_ms=300)).goodput == pytest.approx(1 / 1.5)  # only b
    assert summarize([a, b, c], SLO(ttft_ms=600, tpot_ms=200)).goodput == pytest.approx(1 / 1.5)  # b's tpot 300
    assert summarize([a, b, c], SLO(e2el_ms=900)).goodput == pytest.approx(2 / 1.5)


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
                     '{"arrival_s": 12, "prompt_tokens": 7, "output_tokens": 1}\n')
    reqs, arrivals = replay(trace, PromptMaker(np.random.default_rng(0)), None, {})
    assert arrivals == [0.0, 1.5] and [r.max_tokens for r in reqs] == [3, 1]
    assert len(reqs[1].prompt.split()) == 7
    trace.write_text('{"timestamp": 1}\n')
    with pytest.raises(BriskError, match=":1: need timestamp"):
        replay(trace, PromptMaker(np.random.default_rng(0)), None, {})


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
