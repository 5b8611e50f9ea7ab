"""One request's failure stays that request's (issue 61). Faults are injected into one request's own work
(its detokenizer, its sampling, its tool-call reader, its grammar) while 15 other streams run: the faulty
requests end with an error naming an internal error and their request id, every other stream finishes
with exactly the text it gets without the faults, /health stays 200, the failures are counted in
/metrics, and no KV block is left held."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from brisk.engine.engine import LLMEngine
from brisk.engine.sampler import Sampler
from brisk.structured.tools import ToolCallParser, ToolPlan
from engines import make_engine
from live_server import serve_engine

MODEL = "smollm2-135m-instruct"
PROMPTS = [f"Write one sentence about the number {i}." for i in range(15)]
MAX_TOKENS = 24
UNWRITABLE = "\U00040000"  # UTF-8 F1 80 80 80: the demo's byte-level vocabulary has no token for 0xF1


class _Raises:
    """A request's detokenizer or tool-call reader that works `after` times, then raises."""

    def __init__(self, wrapped, after: int):
        self.wrapped, self.calls, self.after = wrapped, 0, after

    def __getattr__(self, name):
        attr = getattr(self.wrapped, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls > self.after:
                raise RuntimeError(f"injected fault in {name}")
            return attr(*args, **kwargs)
        return call


class _RejectsAt:
    """A grammar matcher whose consume step rejects the k-th token (as llguidance did for a token its own
    mask allowed), and otherwise is the matcher itself."""

    def __init__(self, matcher, k: int):
        self.matcher, self.seen, self.k = matcher, 0, k

    def consume_token(self, token):
        self.seen += 1
        return False if self.seen >= self.k else self.matcher.consume_token(token)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


@pytest.fixture(scope="module")
def faulty_server(demo):
    """The demo engine behind a live server, with faults injected into the requests whose cache_salt names
    one (fault:detokenizer, fault:sampler, fault:tool_parser, fault:grammar): the salt only keys prefix
    sharing, so the request is otherwise an ordinary one."""
    engine = make_engine(demo)
    add_request, sample = LLMEngine.add_request, Sampler.__call__

    def add_with_faults(self, *args, **kwargs):
        request_id = add_request(self, *args, **kwargs)
        request = self.scheduler.requests[request_id]
        if request.cache_salt == "fault:detokenizer":
            request.detokenizer = _Raises(request.detokenizer, after=3)
        elif request.cache_salt == "fault:tool_parser":  # the demo's template renders no tools: a reader of its own
            request.tool_calls = _Raises(ToolCallParser(ToolPlan([], "auto", None, True, "hermes")), after=2)
        elif request.cache_salt == "fault:grammar":
            request.grammar = _RejectsAt(request.grammar, k=2)
        return request_id

    def sample_with_faults(self, logits, requests, drafts=None):
        if any(r.cache_salt == "fault:sampler" and r.num_output_tokens >= 3 for r in requests):
            raise RuntimeError("injected fault in the sampler")
        return sample(self, logits, requests, drafts)

    patches = pytest.MonkeyPatch()
    patches.setattr(LLMEngine, "add_request", add_with_faults)
    patches.setattr(Sampler, "__call__", sample_with_faults)
    try:
        with serve_engine(engine) as live:
            yield live
    finally:
        patches.undo()


def _stream(live, prompt: str, salt: str | None = None, **extra) -> tuple[str, dict | None]:
    """(text, error event or None) of one streamed chat completion."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "stream": True, **extra}
    if salt:
        body["cache_salt"] = salt
    text, error = "", None
    with httpx.Client(base_url=live.url, timeout=120) as http, http.stream("POST", "/v1/chat/completions",
                                                                          json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
    return text, error


def _run_all(live, faulty: list[tuple[str, dict]]) -> tuple[list[str], list[tuple[str, str, dict | None]]]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + len(faulty)) as pool:
        good = [pool.submit(_stream, live, p) for p in PROMPTS]
        bad = [(salt, pool.submit(_stream, live, "Tell me about Paris.", salt, **extra)) for salt, extra in faulty]
        texts = []
        for f in good:
            text, error = f.result()
            assert error is None, error
            texts.append(text)
        return texts, [(salt, *f.result()) for salt, f in bad]


def _metric(text: str, name: str, label: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{') and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} with {label} is not in /metrics")


def test_one_requests_fault_fails_it_alone(faulty_server):
    live = faulty_server
    baseline, _ = _run_all(live, [])
    assert all(baseline)
    faulty = [("fault:detokenizer", {}), ("fault:sampler", {}), ("fault:tool_parser", {}),
              ("fault:grammar", {"guided_choice": ["Paris is lovely", "Paris is big"]}),
              # no fault injected: a grammar needing a byte the demo vocabulary has no token for (0xF1)
              ("unsatisfiable", {"guided_regex": f"(Paris|London) {UNWRITABLE}"})]
    texts, failures = _run_all(live, faulty)
    assert texts == baseline  # the 15 others, token for token
    for salt, text, error in failures:
        assert error is not None, f"{salt}: no error event"
        if salt == "unsatisfiable":  # the request's grammar is at fault: a client error naming the field
            assert error["code"] == "grammar_unsatisfiable" and error["param"] == "guided_regex", error
            assert error["type"] == "invalid_request_error" and "cannot be met" in error["message"], error
            assert text and any(alt.startswith(text) for alt in ("Paris ", "London ")), text
            continue
        reason = "grammar_rejected" if salt == "fault:grammar" else "internal_error"
        assert error["code"] == reason, (salt, error)
        assert error["type"] == "server_error" and "chatcmpl-" in error["message"], (salt, error)
    with live.client() as http:
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics").text
        # a non-streamed request gets the same error as a response
        r = http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS,
                                                    "messages": [{"role": "user", "content": "Hi"}],
                                                    "cache_salt": "fault:detokenizer"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        assert r.json()["error"]["message"].startswith("an internal error ended request chatcmpl-")
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4,
                                               "guided_regex": f"(a|b){UNWRITABLE}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_unsatisfiable", r.text
        assert r.json()["error"]["param"] == "guided_regex", r.text
        metrics = http.get("/metrics").text
    assert _metric(metrics, "brisk:request_errors_total", 'reason="internal_error"') >= 3
    assert _metric(metrics, "brisk:request_errors_total", 'reason="grammar_rejected"') >= 1
    assert _metric(metrics, "brisk:request_errors_total", 'reason="grammar_unsatisfiable"') >= 2
    stats = live.wait_idle()
    assert stats.kv_blocks_used == 0  # every failed request's blocks were freed
    texts, _ = _run_all(live, [])
    assert texts == baseline  # and the engine serves on, unchanged
