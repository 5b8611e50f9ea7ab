"""The server under failure: loading, overload, disconnects, timeouts, a dying engine,
auth, and every kind of bad input — each ends with one clear error, never a hang or a 500."""

import asyncio
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from brisk.config import CacheConfig
from brisk.engine.async_engine import AsyncLLMEngine
from brisk.engine.engine import LLMEngine
from brisk.engine.scheduler import SchedulerConfig
from brisk.errors import ModelLoadError
from brisk.server.state import ServerConfig, ServerState

from live_server import LiveServer, serve_engine
from engines import make_engine

CHAT = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]
LONG = {"messages": CHAT, "max_tokens": 600, "ignore_eos": True, "temperature": 0}


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


# -- cold start ---------------------------------------------------------------------
def test_503_with_phase_while_loading_then_ready(demo):
    gate = threading.Event()

    def factory(report):
        with report.phase("module_build"):
            gate.wait(timeout=60)
        with report.phase("engine"):
            return AsyncLLMEngine(make_engine(demo))

    with LiveServer(ServerState(ServerConfig(), engine_factory=factory)) as live, live.client() as http:
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "2"
        body = ready.json()
        assert body["status"] == "loading" and body["phase"] == "module_build" and 0 <= body["progress"] < 1
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "model_loading" and "module_build" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 200  # alive while loading: no restart loop
        assert http.get("/metrics").status_code == 200
        gate.set()
        deadline = time.monotonic() + 30
        while http.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.05)
        assert http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).status_code == 200
        text = http.get("/metrics").text
        assert metric(text, "brisk:model_load_state", state="ready") == 1.0
        assert metric(text, "brisk:model_load_phase_seconds_count", phase="module_build") == 1.0


def test_ready_mid_publication_is_503_never_500(demo, monkeypatch):
    """/ready asked while the load thread is publishing the engine (building its grammar compiler:
    the moment a 7B warm start's polling once hit, when the engine was set before ready_ts) answers
    503, and 200 with the load time once it is done."""
    import brisk.server.state as state_module

    seen = []
    real = state_module.GrammarCompiler

    def compiler(*args, **kwargs):
        seen.append(httpx.get(f"{live.url}/ready", timeout=30).status_code)  # from the load thread
        return real(*args, **kwargs)

    def factory(report):
        gate.wait(timeout=60)  # until `live` (its url) is bound below
        return AsyncLLMEngine(make_engine(demo))

    gate = threading.Event()
    monkeypatch.setattr(state_module, "GrammarCompiler", compiler)
    with LiveServer(ServerState(ServerConfig(), engine_factory=factory)) as live, live.client() as http:
        gate.set()
        deadline = time.monotonic() + 30
        while http.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.02)
        assert seen == [503]
        assert http.get("/ready").json()["load_s"] >= 0


def test_failed_load_is_reported_not_hidden(demo):
    def factory(report):
        raise ModelLoadError("model.gguf: truncated file; re-download it")

    with LiveServer(ServerState(ServerConfig(), engine_factory=factory)) as live, live.client() as http:
        deadline = time.monotonic() + 10
        while http.get("/ready").json().get("status") != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "truncated file" in http.get("/ready").json()["error"]
        assert http.get("/health").status_code == 503
        r = http.post("/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"


# -- overload, disconnects, timeouts -------------------------------------------------------
def test_429_past_the_queue_cap_then_recovers(demo):
    with serve_engine(make_engine(demo, max_num_seqs=1), max_queued_requests=1) as live:
        async def scenario():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                streams = []
                for _ in range(2):  # one running, one queued
                    cm = http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True})
                    resp = await cm.__aenter__()
                    assert resp.status_code == 200
                    streams.append(cm)
                over = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
                for cm in streams:
                    await cm.__aexit__(None, None, None)
                return over

        over = asyncio.run(scenario())
        assert over.status_code == 429 and over.headers["retry-after"] == "2"
        assert over.json()["error"]["code"] == "overloaded" and over.json()["error"]["type"] == "rate_limit_error"
        live.wait_idle()
        with live.client() as http:
            assert http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def server(demo):
    with serve_engine(make_engine(demo, num_blocks=256), request_timeout_s=None) as live:
        yield live


def test_stream_disconnect_frees_blocks(server):
    with server.client() as http, http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 4:
                break
    stats = server.wait_idle(timeout_s=10)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    with server.client() as http:
        assert metric(http.get("/metrics").text, "brisk:request_aborts_total", cause="client_disconnect") >= 1


def test_non_stream_disconnect_frees_blocks(server):
    server.post_and_disconnect("/v1/chat/completions", LONG)
    stats = server.wait_idle(timeout_s=10)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_request_timeout_ends_stream_and_non_stream(demo):
    with serve_engine(make_engine(demo), request_timeout_s=0.8) as live, live.client() as http:
        r = http.post("/v1/chat/completions", json=LONG)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as s:
            events = sse_events(s.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        stats = live.wait_idle(timeout_s=10)
        assert stats.kv_blocks_used == 0


# -- a dying engine ------------------------------------------------------------------------
def test_engine_failure_ends_every_open_stream(demo):
    engine = make_engine(demo)
    real_step, steps = engine.step, {"n": 0}

    def failing_step():
        steps["n"] += 1
        if steps["n"] > 6:
            raise RuntimeError("simulated kernel fault")
        return real_step()

    engine.step = failing_step
    with serve_engine(engine) as live:
        results = []

        def stream():
            with live.client(timeout=30) as http, http.stream(
                    "POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
                results.append(sse_events(r.iter_lines()))

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a stream hung after the engine died"
        assert len(results) == 3
        for events in results:
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
            assert "simulated kernel fault" in events[-2]["error"]["message"]
        with live.client() as http:
            assert http.get("/health").status_code == 503
            assert http.get("/ready").status_code == 503
            r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


# -- auth -------------------------------------------------------------------------------------
def test_api_key(demo):
    import openai

    with serve_engine(make_engine(demo), api_key="sekrit") as live, live.client() as http:
        missing = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        for r in (missing, wrong):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = http.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200  # probes need no key
        with pytest.raises(openai.AuthenticationError):
            live.openai(api_key="nope").models.list()
        assert live.openai(api_key="sekrit").models.list().data[0].id == "smollm2-135m-instruct"


# -- bad input -------------------------------------------------------------------------------
BAD = [
    ("malformed json", b'{"messages": [', 400, None),
    ("body not an object", b"[1, 2]", 400, None),
    ("messages missing", {"max_tokens": 3}, 400, "messages"),
    ("messages not a list", {"messages": "hello"}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("non-string content", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("user content null", {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("max_tokens zero", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens not int", {"messages": CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens beyond window", {"messages": CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ("temperature high", {"messages": CHAT, "temperature": 5}, 400, "temperature"),
    ("top_p above one", {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("top_logprobs too many", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("n zero", {"messages": CHAT, "n": 0}, 400, "n"),
    ("stop not a string", {"messages": CHAT, "stop": 3}, 400, "stop"),
    ("empty stop string", {"messages": CHAT, "stop": [""]}, 400, "stop[0]"),
    ("unknown model", {"messages": CHAT, "model": "gpt-9"}, 404, "model"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_chat_input(server, name, body, status, param):
    with server.client() as http:
        if isinstance(body, bytes):
            r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        else:
            r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param and param.split(".")[0].split("[")[0] in err["message"]


BAD_COMPLETIONS = [
    ("empty prompt list", {"prompt": []}, "prompt"),
    ("token id out of range", {"prompt": [1, 99999999]}, "prompt"),
    ("prompt wrong type", {"prompt": {"a": 1}}, "prompt"),
    ("logprobs too many", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("negative frequency penalty", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
]


@pytest.mark.parametrize("name,body,param", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_input(server, name, body, param):
    with server.client() as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_tokenize_input(server):
    with server.client() as http:
        both = http.post("/tokenize", json={"prompt": "a", "messages": CHAT})
        bad_ids = http.post("/detokenize", json={"tokens": [-1]})
    assert both.status_code == 400 and bad_ids.status_code == 400
    assert bad_ids.json()["error"]["param"] == "tokens[0]"


def test_oversized_body_413(demo):
    with serve_engine(make_engine(demo), max_request_bytes=4096) as live, live.client() as http:
        big = {"messages": [{"role": "user", "content": "x" * 10000}]}
        r = http.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and "4096" in r.json()["error"]["message"]

        def chunks():  # no content-length: the limit is enforced while reading
            yield json.dumps(big).encode()

        r = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]


def test_no_500_was_ever_sent(server):
    with server.client() as http:
        text = http.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    statuses = {s.labels["status"] for s in fams["brisk:http_responses"].samples}
    assert statuses and not any(s.startswith("5") for s in statuses)


def test_small_kv_pool_engine_is_usable_through_server(demo):
    """Preemption under a tiny pool is invisible to clients: every stream completes (with the
    same greedy text: batch-invariant under preemption, see test_engine_batching)."""
    engine = LLMEngine(demo, CacheConfig(block_size=16, num_gpu_blocks_override=12),
                       SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=160))
    with serve_engine(engine) as live:
        async def many():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                body = {"messages": CHAT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
                return await asyncio.gather(*[http.post("/v1/chat/completions", json=body) for _ in range(4)])

        responses = asyncio.run(many())
        assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40 for r in responses)
        assert len({r.json()["choices"][0]["message"]["content"] for r in responses}) == 1
        with live.client() as http:
            assert metric(http.get("/metrics").text, "brisk:num_preemptions_total") >= 1


def test_extreme_valid_sampling_settings_do_not_kill_the_engine(server):
    """Found by the fuzzer: a repetition penalty near 0 made logits inf and softmax NaN."""
    with server.client() as http:
        for extra in ({"repetition_penalty": 1e-300}, {"temperature": 2e-5}, {"frequency_penalty": -2,
                                                                               "presence_penalty": -2}):
            r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, **extra})
            assert r.status_code == 200, (extra, r.text)
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("allow", [True, False])
def test_priority_only_when_the_operator_allows_it(demo, allow):
    with serve_engine(make_engine(demo, max_num_seqs=1), allow_priority=allow) as live:
        async def scenario():
            order = []
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                async def ask(name, priority, delay):
                    await asyncio.sleep(delay)
                    body = {"messages": CHAT, "max_tokens": 4, "priority": priority}
                    r = await http.post("/v1/chat/completions", json=body)
                    order.append((name, r.status_code))

                # long enough to still be running when both arrive, however fast the engine decodes
                blocker = http.post("/v1/chat/completions", json={**LONG, "max_tokens": 300})
                await asyncio.gather(blocker, ask("first-come", 0, 0.3), ask("urgent", -5, 0.6))
            return order

        order = asyncio.run(scenario())
    names = [name for name, status in order if status == 200]
    assert names == (["urgent", "first-come"] if allow else ["first-come", "urgent"])
