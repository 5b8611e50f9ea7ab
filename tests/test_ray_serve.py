"""`brisk serve --replicas 2` end to end: a local Ray cluster with two engine replicas (1 CPU each),
started once for this module as a user would start it, driven with the official openai SDK.

Proves: the same API and greedy results as single-process brisk; prefix affinity (a shared system
prompt stays on one replica, distinct prefixes spread) and its load fallback, from the replicas'
own metrics; a replica killed mid-stream ends every open stream (completion or error event), the
next requests succeed, and Ray Serve brings the replica count back to 2.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the `ray` extra is part of make test's install")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster of 2 replicas: `pytest -m 'not slow'` skips it locally

MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 240
SYSTEM = ("You are the support assistant of Northwind Traders. Answer questions about orders, shipping, returns "
          "and invoices politely and briefly. Orders ship within two business days from the Oslo warehouse; "
          "returns are accepted for thirty days with the original receipt; invoices are emailed on dispatch. "
          "Never promise a delivery date; give the usual range of three to five days instead. ") * 2
QUESTIONS = ["Where is my order 1234?", "Can I return a lamp?", "When is my invoice sent?",
             "Do you ship to Finland?", "How long does delivery take?", "Can I change my address?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(brisk_cache):
    port = _free_port()
    log_path = brisk_cache / "ray-serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "brisk", "serve", MODEL, "--replicas", "2", "--replica-cpus", "1",
         "--port", str(port), "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--router-max-imbalance", "2",
         "--shutdown-timeout", "30"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"brisk serve --replicas exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200 and len(_replica_samples(url)) == 2:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no 2 ready replicas in {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
        time.sleep(1)
    try:
        yield url, proc
        _drain_on_sigterm(url, proc, log_path)
    finally:  # whatever failed above, no replica outlives this module (they would slow every later test)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def _drain_on_sigterm(url: str, proc: subprocess.Popen, log_path) -> None:
    """Graceful shutdown drains like single-process serve: a running stream finishes, new requests get 503."""
    outcome, started = {}, threading.Event()
    stream = threading.Thread(target=_stream, args=(url, 60, outcome, started))
    stream.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:  # as in one process: the listening socket closes; a request that still gets in is a 503
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                             timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    except httpx.ConnectError:
        pass
    stream.join(timeout=60)
    assert outcome.get("end") == "done", outcome
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("brisk serve --replicas did not exit within 90 s of SIGTERM") from None
    assert proc.returncode == 0, log_path.read_text()[-4000:]


@pytest.fixture(scope="module")
def reference(demo):
    """Single-process brisk on the same model (in this process)."""
    from brisk.config import CacheConfig
    from brisk.engine.engine import LLMEngine
    from brisk.engine.scheduler import SchedulerConfig
    from tests.live_server import serve_engine

    engine = LLMEngine(demo, CacheConfig(kv_cache_memory=256 * 2**20), SchedulerConfig(max_model_len=2048))
    with serve_engine(engine, served_model_name=MODEL) as server:
        yield server


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _replica_samples(url: str, name: str = "brisk:prefix_cache_queries_total") -> dict[str, float]:
    return {dict(labels)["replica"]: v for (n, labels), v in _metrics(url).items()
            if n == name and "replica" in dict(labels)}


def _decisions(url: str) -> dict[str, float]:
    return {dict(labels)["reason"]: v for (n, labels), v in _metrics(url).items()
            if n == "brisk:router_decisions_total"}


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_sdk_greedy_results_equal_single_process_brisk(cluster, reference):
    """Both sides get the same calls in the same order, so their prefix caches hold the same
    blocks at each call: with quantized weights a prefix-cache hit (a repeated prompt's second
    call) can change a greedy token, so a repeated call is compared with the reference's repeated
    call (RESULTS.md, "Greedy batch invariance with quantized weights")."""
    url, _ = cluster
    remote, local = _client(url), reference.openai()
    for prompt in ("The three primary colours are", "def fibonacci(n):"):
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        expected = local.completions.create(**kwargs).choices[0].text
        expected_again = "".join(c.choices[0].text for c in local.completions.create(stream=True, **kwargs)
                                 if c.choices)
        assert remote.completions.create(**kwargs).choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in remote.completions.create(stream=True, **kwargs) if c.choices)
        assert streamed == expected_again
    messages = [{"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": "Why is the sky blue?"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    expected = local.chat.completions.create(**kwargs)
    expected_again = local.chat.completions.create(**kwargs)
    got = remote.chat.completions.create(**kwargs)
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    chunks = list(remote.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        expected_again.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == expected_again.usage.completion_tokens
    # n > 1: sibling engine requests of one HTTP request (a Ray Serve request context) all complete
    many = remote.completions.create(model=MODEL, prompt="List three fruits:", max_tokens=6, n=3, temperature=1.0,
                                     seed=5)
    assert sorted(c.index for c in many.choices) == [0, 1, 2] and many.usage.completion_tokens == 18
    # the single-process server's errors, through the ingress: one clear 400 naming the field
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10**7},
                          timeout=30)
    assert response.status_code == 400 and "max_tokens" in response.text


def _streamed_logprobs(url: str, **body) -> tuple[str, list, list]:
    text, tokens, offsets = "", [], []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"]
                if choice.get("logprobs"):
                    tokens += choice["logprobs"]["tokens"]
                    offsets += choice["logprobs"]["text_offset"]
    return text, tokens, offsets


def test_streamed_completion_logprobs_offsets_equal_one_process(cluster, reference):
    """Issue 36: replicas sent non-final outputs without their cumulative text, and the streamed
    text_offset was computed from it. Through --replicas the offsets equal one process's, and each
    token's offset points at that token in the streamed text (with and without echo)."""
    url, _ = cluster
    for echo in (False, True):
        body = dict(prompt="Counting slowly: one, two,", max_tokens=12, temperature=0, logprobs=1, echo=echo)
        remote = _streamed_logprobs(url, **body)
        assert remote == _streamed_logprobs(reference.url, **body)
        text, tokens, offsets = remote
        generated = [(t, o) for t, o in zip(tokens, offsets)]
        assert len(generated) == 12 and all(text[o:o + len(t)] == t for t, o in generated), generated
        assert offsets == sorted(offsets) and (offsets[0] > 0) == echo


def test_shared_prefix_stays_on_one_replica_and_distinct_prefixes_spread(cluster):
    url, _ = cluster
    client = _client(url)
    before, decisions_before = _replica_samples(url), _decisions(url)
    for question in QUESTIONS:  # one after another: equal load, so only affinity decides
        client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    after = _replica_samples(url)
    grew = {r: after[r] - before.get(r, 0) for r in after if after[r] > before.get(r, 0)}
    assert len(grew) == 1, f"the shared system prompt was served by {grew}"
    hits = _replica_samples(url, "brisk:prefix_cache_hits_total")
    assert hits[next(iter(grew))] > 0
    decisions = _decisions(url)
    assert decisions["prefix"] - decisions_before.get("prefix", 0) >= len(QUESTIONS) - 1

    before = after
    for i in range(6):  # distinct long prefixes: spread over both replicas
        client.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                  prompt=f"Document {i}: " + f"record {i} of the archive, " * 30)
    after = _replica_samples(url)
    assert all(after[r] > before.get(r, 0) for r in after), (before, after)


def test_an_overloaded_affine_replica_yields_to_the_other(cluster):
    url, _ = cluster
    before, decisions_before = _replica_samples(url), _decisions(url)
    prompt = "Shared preamble for the load test. " * 20
    results = []

    def one(i):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt + f"Item {i}:", "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=180)
    assert results == [200] * 8
    after = _replica_samples(url)
    assert all(after[r] > before.get(r, 0) for r in after), "one replica took every request of the burst"
    assert _decisions(url)["load"] > decisions_before.get("load", 0)


def test_brisk_top_reads_the_ingress(cluster):
    url, _ = cluster
    out = subprocess.run([sys.executable, "-m", "brisk", "top", url, "--once", "--interval", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for needle in ("brisk top", "throughput", "KV cache", "prefix"):
        assert needle in out.stdout, out.stdout
    total = re.search(r"\d+/(\d+) blocks", out.stdout)
    assert total is not None, out.stdout
    per_replica = _replica_samples(url, "brisk:kv_num_blocks")
    assert len(per_replica) == 2 and int(total.group(1)) == sum(per_replica.values())  # the replicas' pools add up


def _stream(url: str, max_tokens: int, outcome: dict, started: threading.Event) -> None:
    """One SSE stream; records how it ended: 'done' (finish_reason), 'error' (error event) or 'broken'."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=httpx.Timeout(60, read=60), json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.8,
                "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome["end"], outcome["code"] = "error", event["error"].get("code")
                    return
                started.set()
                if event["choices"][0]["finish_reason"]:
                    outcome["end"] = "done"
    except httpx.HTTPError as e:
        outcome["end"] = f"broken: {e!r}"


def _replica_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ServeReplica:brisk:BriskEngine"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_client_that_disconnects_mid_stream_stops_its_generation(cluster):
    """The abort crosses to the replica (the Ray call is cancelled; its outputs were on the channel):
    the replicas run far fewer steps than the 1,900 tokens asked for, and nothing stays running."""
    url, _ = cluster

    def total(name):
        return sum(_replica_samples(url, name).values())

    assert total("brisk:num_requests_running") == 0
    steps_before = total("brisk:engine_steps_total")
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 120  # liveness only; a request that is never aborted runs 1,900 steps
    while total("brisk:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the disconnected request is still running on its replica"
        time.sleep(0.2)
    assert total("brisk:engine_steps_total") - steps_before < 1000


def test_replica_killed_mid_stream_ends_every_stream_and_is_replaced(cluster):
    url, proc = cluster
    pids = _replica_pids()
    assert len(pids) == 2, pids
    outcomes = [{} for _ in range(8)]
    started = [threading.Event() for _ in range(8)]
    threads = [threading.Thread(target=_stream, args=(url, 400, outcomes[i], started[i])) for i in range(8)]

    def aborts(cause: str) -> float:
        return _metrics(url).get(("brisk:request_aborts_total", (("cause", cause),)), 0.0)

    disconnects_before, lost_before = aborts("client_disconnect"), aborts("replica_lost")
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(120), "a stream never produced its first token"
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
    ended_s = time.monotonic() - t0
    ends = [o.get("end") for o in outcomes]
    assert set(ends) <= {"done", "error"}, ends
    assert "error" in ends, f"no stream lost its replica: {ends}"  # both replicas had streams (load routing)
    assert {o["code"] for o in outcomes if o["end"] == "error"} == {"replica_lost"}
    assert ended_s < 90
    # counted as what they were: lost with their replica, not left by their clients
    assert aborts("replica_lost") - lost_before == ends.count("error")
    assert aborts("client_disconnect") == disconnects_before
    # the service goes on: the next 16 requests succeed on the remaining replica (or its replacement)
    client = _client(url)
    for i in range(16):
        reply = client.completions.create(model=MODEL, prompt=f"Request {i}:", max_tokens=3, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")
    # Ray Serve replaces the dead replica
    deadline = time.monotonic() + 120
    while len(_replica_pids()) != 2 or len(_replica_samples(url)) != 2:
        assert time.monotonic() < deadline, f"replica count did not return to 2: {_replica_pids()}"
        time.sleep(1)
    assert proc.poll() is None


def test_rays_metrics_export_is_off_unless_asked_for(cluster):
    """Ray's metrics export listens on every interface without authentication and carries Serve's
    per-deployment request series: brisk starts its local Ray instance without it (--ray-metrics opts in)."""
    from pathlib import Path

    files = sorted(Path("/tmp/ray/session_latest").glob("metrics_export_port_*"))
    assert files, "no Ray session of this cluster"
    port = int(files[-1].read_text().strip())
    if port > 0:  # recorded but it must not answer
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    else:
        assert port == -1
