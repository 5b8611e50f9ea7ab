"""`brisk doctor` against servers that each misbehave in one way: each pathology, and only it,
is flagged. Then a quick run against `brisk serve` itself, and the HTML report's plots."""

import base64
import io
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import serve_engine
from test_engine_batching import make_engine

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
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def statuses(report: dict) -> dict[str, str]:
    return {area: f["status"] for area, f in report["findings"].items()}


HEALTHY = {"network": "ok", "cold_start": "ok", "kv_batching": "ok", "context": "ok"}


@pytest.mark.parametrize("flags,area,needle", [
    ({}, None, None),
    ({"truncate_to": 256}, "context", "silent truncation"),
    ({"cold_start_s": 4.0, "first_request_delay_s": 2.5}, "cold_start", "503"),
    ({"buffered": True}, "network", "buffered"),
    ({"serial": True}, "kv_batching", "one at a time"),
], ids=["healthy", "truncates", "cold-start", "buffering-proxy", "serial-queue"])
def test_each_pathology_and_only_it_is_flagged(tmp_path, flags, area, needle):
    proc, url = start_fake(**flags)
    try:
        report = run_doctor(url, tmp_path)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    expected = dict(HEALTHY)
    if area is not None:
        expected[area] = "problem"
        assert needle in report["findings"][area]["summary"]
        assert report["findings"][area]["fixes"], "a problem comes with a fix"
    assert statuses(report) == expected, {a: f["summary"] for a, f in report["findings"].items()}
    assert report["brisk_doctor_schema"] == 1 and report["overall"] == ("problem" if area else "ok")


def test_doctor_quick_against_brisk_serve(demo, tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_text("大语言模型服务为什么第一个请求总是很慢？我们需要测量每一个阶段的时间。" * 5, encoding="utf-8")
    with serve_engine(make_engine(demo)) as live:
        report = run_doctor(live.url, tmp_path, "--html", str(tmp_path / "report.html"), "--sample-file",
                            str(sample))
    assert report["model"] == "smollm2-135m-instruct"
    ctx = report["findings"]["context"]["evidence"]
    assert ctx["window"] == 1024 and ctx["exact_counts"] is True and ctx["overlong_rejected"] is True
    assert ctx["truncated_points"] == 0 and ctx["prefill_ms_per_1k_tokens"] > 0
    # Chinese costs this English-centric tokenizer several tokens per character: reported, with the fix
    assert ctx["sample"]["ratio_vs_english"] > 1.5 and ctx["sample"]["tokens"] > ctx["sample"]["chars"]
    assert any("characters" in fix for fix in report["findings"]["context"]["fixes"])
    batching = report["findings"]["kv_batching"]["evidence"]
    assert batching["engine_metrics"] == "brisk" and batching["levels"] == [1, 2, 4]
    assert report["findings"]["network"]["status"] == "ok"
    assert report["findings"]["cold_start"]["status"] == "ok"
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
