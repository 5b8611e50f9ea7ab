"""`brisk doctor` against servers that each misbehave in one way: each pathology, and only it,
is flagged. Then a quick run against `brisk serve` itself, and the HTML report's plots."""

import base64
import io
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import serve_engine
from engines import make_engine

FAKES = Path(__file__).resolve().parent / "doctor_fakes.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fake(**flags):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKES), str(port), json.dumps(flags)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/v1/models", timeout=1)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fake server did not start")


def run_doctor(url: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "doctor", url, "--quick", "--json", str(out),
                           "--cold-wait", "30", *extra], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def statuses(report: dict) -> dict[str, str]:
    return {area: f["status"] for area, f in report["findings"].items()}


HEALTHY = {"network": "ok", "cold_start": "ok", "kv_batching": "ok", "context": "ok"}


# Each fake misbehaves in one way. The healthy run shows every verdict absent when its cause is;
# each other run shows its verdict present, and only its own (every other area stays ok). Wording
# that belongs to another verdict must not appear ("accepts beyond" is not "truncation").
@pytest.mark.parametrize("flags,area,status,needle,not_needle", [
    ({}, None, None, None, None),
    ({"truncate_to": 256}, "context", "problem", "silent truncation", "beyond its advertised window"),
    ({"accept_overlong": True}, "context", "warning", "accepts prompts beyond its advertised window",
     "truncation"),
    ({"cold_start_s": 4.0, "first_request_delay_s": 2.5}, "cold_start", "problem", "503", None),
    ({"buffered": True}, "network", "problem", "buffered", None),
    ({"serial": True}, "kv_batching", "problem", "one at a time", "compute-bound"),
    ({"compute_bound": True}, "kv_batching", "warning", "compute-bound", "KV cache pressure"),
    ({"kv_pressure": True}, "kv_batching", "warning", "KV cache pressure", "compute-bound"),
    ({"kv_tier_churn": True}, "cold_start", "warning", "the KV disk tier is full (256 of 256 MiB) and held 0%",
     "503"),
], ids=["healthy", "truncates", "accepts-beyond-window", "cold-start", "buffering-proxy", "serial-queue",
        "compute-bound", "kv-pressure", "kv-tier-churn"])
def test_each_pathology_and_only_it_is_flagged(tmp_path, flags, area, status, needle, not_needle):
    proc, url = start_fake(**flags)
    try:
        report = run_doctor(url, tmp_path)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    expected = dict(HEALTHY)
    if area is not None:
        expected[area] = status
        assert needle in report["findings"][area]["summary"]
        assert report["findings"][area]["fixes"], "a finding comes with a fix"
        if not_needle:
            assert not_needle not in report["findings"][area]["summary"]
    assert statuses(report) == expected, {a: f["summary"] for a, f in report["findings"].items()}
    assert report["brisk_doctor_schema"] == 1 and report["overall"] == (status if area else "ok")
    assert report["duration_s"] <= 60


def test_a_tier_is_called_churning_only_when_full_asked_enough_and_missing():
    from brisk.doctor.checks import _tier_churn

    tier = {"budget_bytes": 1000, "bytes": 950, "tokens_read": 100, "tokens_missed": 9900}
    assert "KV disk tier is full" in _tier_churn("disk", tier) and "--kv-cache-disk-bytes" in _tier_churn("disk", tier)
    assert "--kv-cache-host-bytes" in _tier_churn("host", tier)
    assert _tier_churn("disk", {**tier, "bytes": 500}) is None  # room left: not an LRU loop
    assert _tier_churn("disk", {**tier, "tokens_read": 1000}) is None  # 10% held: it helps
    assert _tier_churn("disk", {**tier, "tokens_missed": 2000}) is None  # too few asked to judge
    assert _tier_churn("disk", {**tier, "budget_bytes": 0}) is None and _tier_churn("disk", None) is None


def test_a_probe_that_times_out_is_not_measured_never_ok(tmp_path):
    """A server that never answers long prompts: the doctor gives up within its budget and says
    what it could not measure, instead of calling the context fine."""
    proc, url = start_fake(hang_over=600)
    try:
        report = run_doctor(url, tmp_path, "--budget", "20")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    ctx = report["findings"]["context"]
    assert ctx["status"] == "unknown", ctx
    assert any("timed out" in m for m in ctx["not_measured"]), ctx["not_measured"]
    assert report["duration_s"] <= 30  # 20 s of probes, plus start-up and reporting
    assert report["findings"]["network"]["status"] == "ok"  # short requests were still measured


def test_doctor_quick_against_brisk_serve(demo, tmp_path, caplog):
    sample = tmp_path / "sample.txt"
    sample.write_text("大语言模型服务为什么第一个请求总是很慢？我们需要测量每一个阶段的时间。" * 5, encoding="utf-8")
    with serve_engine(make_engine(demo)) as live:
        report = run_doctor(live.url, tmp_path, "--html", str(tmp_path / "report.html"), "--sample-file",
                            str(sample))
        # a client that gives up (as a doctor probe past its timeout does) is an info line, not an error
        caplog.set_level(logging.INFO)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/chat/completions", timeout=0.5,
                       json={"messages": [{"role": "user", "content": "word " * 900}], "max_tokens": 5})
        deadline = time.monotonic() + 30
        while not any("client disconnected" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the disconnect was never logged"
            time.sleep(0.1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert report["model"] == "smollm2-135m-instruct" and report["duration_s"] <= 60
    # the warning is the sample text's token cost, which the --sample-file asked about
    kv = report["findings"]["kv_batching"]
    assert statuses(report) == {**HEALTHY, "context": "warning", "kv_batching": kv["status"]}
    # brisk batches (never "one at a time") and its KV cache is idle here (never "pressure"). On 2
    # shared cores its throughput per stream at 4 streams lands at 0.43-0.66 of one stream's
    # (measured over 9 runs, with either attention path), around the doctor's 0.45 line: a verdict
    # of "compute-bound" is then true too, and must say so
    assert kv["status"] == "ok" or (kv["status"] == "warning" and kv["summary"].startswith("compute-bound")), (
        kv["summary"], report["measurements"]["concurrency"])
    # the 135M demo model sometimes misses the early fact in the doctor's random 768-token filler: a true
    # warning, which then comes first; the sample's cost must be reported either way
    assert "your sample text costs" in report["findings"]["context"]["summary"]
    ctx = report["findings"]["context"]["evidence"]
    assert ctx["window"] == 1024 and ctx["exact_counts"] is True and ctx["overlong"] == "rejected"
    assert ctx["truncated_points"] == 0 and ctx["prefill_ms_per_1k_tokens"] > 0
    # Chinese costs this English-centric tokenizer several tokens per character: reported, with the fix
    assert ctx["sample"]["ratio_vs_english"] > 1.5 and ctx["sample"]["tokens"] > ctx["sample"]["chars"]
    assert any("characters" in fix for fix in report["findings"]["context"]["fixes"])
    batching = report["findings"]["kv_batching"]["evidence"]
    assert batching["engine_metrics"] == "brisk" and batching["levels"] == [1, 2, 4]
    # brisk exports brisk:kv_usage_ratio, and every quick level samples it at its start and end at least
    assert batching["max_kv_usage"] is not None
    assert not any("KV cache usage" in m for m in report["findings"]["kv_batching"]["not_measured"])
    assert report["findings"]["network"]["status"] == "ok"
    assert report["findings"]["cold_start"]["status"] == "ok"
    # brisk's /metrics say whether cached prompts survive a restart: no --kv-cache-dir here
    assert report["findings"]["cold_start"]["evidence"]["kv_disk_tier"]["budget_bytes"] == 0
    sweep = report["measurements"]["context"]["sweep"]
    assert all(r["client_tokens"] == r["server_prompt_tokens"] for r in sweep)  # counts agree exactly
    html = (tmp_path / "report.html").read_text()
    images = [base64.b64decode(chunk.split('"')[0]) for chunk in html.split("data:image/png;base64,")[1:]]
    assert len(images) == 3  # TTFT vs prompt length, latency vs concurrency, phase breakdown
    import matplotlib.image

    for png in images:
        pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
        assert pixels.shape[0] > 100 and np.std(pixels) > 0.05  # a drawn plot, not a blank image


def test_doctor_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "brisk", "doctor", "http://127.0.0.1:9", "--quick"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot connect" in proc.stderr and "Traceback" not in proc.stderr
    fake, url = start_fake()
    try:
        proc = subprocess.run([sys.executable, "-m", "brisk", "doctor", url + "/v1", "--quick"],
                              capture_output=True, text=True, timeout=60)
    finally:
        fake.kill()
    assert proc.returncode == 2 and "not an OpenAI-compatible API" in proc.stderr


def test_metrics_scrape_adds_counts_across_replicas_and_keeps_the_fullest_kv_usage():
    """Behind a Ray Serve ingress every engine series carries a `replica` label: a summed KV usage
    of 0.6 + 0.7 would report an impossible 130%."""
    from types import SimpleNamespace

    from brisk.doctor.checks import scrape

    body = ('brisk:kv_usage_ratio{replica="a"} 0.6\nbrisk:kv_usage_ratio{replica="b"} 0.7\n'
            'brisk:num_requests_waiting{replica="a"} 2\nbrisk:num_requests_waiting{replica="b"} 3\n')
    prober = SimpleNamespace(get=lambda path: SimpleNamespace(ok=True, body=body))
    metrics = scrape(prober)
    assert metrics["brisk:kv_usage_ratio"] == 0.7
    assert metrics["brisk:num_requests_waiting"] == 5


STABLE_FAKES = [({}, HEALTHY), ({"serial": True}, {**HEALTHY, "kv_batching": "problem"}),
                ({"compute_bound": True}, {**HEALTHY, "kv_batching": "warning"})]


RUNS = 3  # quick runs in a row (each ~5-17 s on 2 cores): enough to see a verdict flip between runs


@pytest.mark.parametrize("flags,expected", STABLE_FAKES, ids=["healthy", "serial-queue", "compute-bound"])
def test_repeated_quick_runs_give_the_same_statuses(tmp_path, flags, expected):
    """--quick runs the same probes every time, and its verdicts sit far from where these servers
    land: RUNS runs in a row against one server, identical reports' statuses."""
    proc, url = start_fake(**flags)
    try:
        runs = [run_doctor(url, tmp_path) for _ in range(RUNS)]
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert [statuses(r) for r in runs] == [expected] * RUNS, [
        {a: f["summary"] for a, f in r["findings"].items()} for r in runs]
    assert all(r["skipped"] == [] for r in runs)  # the whole plan, every time


def test_repeated_quick_runs_against_brisk_serve_give_the_same_statuses(demo, tmp_path):
    with serve_engine(make_engine(demo)) as live:
        runs = [run_doctor(live.url, tmp_path) for _ in range(RUNS)]
    got = [statuses(r) for r in runs]
    assert got == [got[0]] * RUNS, [{a: f["summary"] for a, f in r["findings"].items()} for r in runs]
    assert all(r["skipped"] == [] for r in runs)
    assert got[0]["kv_batching"] in ("ok", "warning") and got[0]["network"] == got[0]["cold_start"] == "ok"


def test_a_level_shorter_than_one_poll_still_samples_the_kv_gauge(demo, monkeypatch):
    """A quick level can end before the 0.25 s poller's first scrape: its start and end samples still see brisk's
    KV gauge (the doctor used to report "no KV usage gauge" for brisk then). The poller is switched off here, as a
    level shorter than one poll leaves it."""
    from brisk.doctor import checks
    from brisk.doctor.probe import Prober

    monkeypatch.setattr(checks._Sampler, "_run", lambda self: None)
    with serve_engine(make_engine(demo)) as live:
        p = Prober(live.url)
        try:
            finding, data = checks.check_concurrency(p, checks.Options("smollm2-135m-instruct", quick=True))
        finally:
            p.close()
    assert data["engine_metrics"] == "brisk"
    assert all(level["metrics_scrapes"] >= 2 * level["rounds"] for level in data["levels"])
    assert finding.evidence["max_kv_usage"] is not None
    assert not any("KV cache usage" in m for m in finding.not_measured), finding.not_measured
