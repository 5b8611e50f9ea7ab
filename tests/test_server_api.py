"""e2e: a real uvicorn server on loopback, driven by the official `openai` SDK."""

import json

import pytest

from brisk.engine.sampling_params import SamplingParams

from live_server import serve_engine
from engines import make_engine

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers in Europe."}]


@pytest.fixture(scope="module")
def server(demo):
    with serve_engine(make_engine(demo)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def offline(demo, ids, **params):
    engine = make_engine(demo)
    engine.add_request(ids, SamplingParams(**params))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final


def test_chat_greedy_equals_offline_engine(demo, client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    ref = offline(demo, demo.tokenizer.encode_chat(CHAT), max_tokens=24, temperature=0)
    choice = resp.choices[0]
    assert choice.message.content == ref.text and choice.message.role == "assistant"
    assert choice.finish_reason == ref.finish_reason
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    assert resp.usage.prompt_tokens == len(demo.tokenizer.encode_chat(CHAT))
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_stream_and_non_stream_agree(demo, client):
    prompt = "The three primary colours are"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ref = offline(demo, demo.tokenizer.encode(prompt), max_tokens=12, temperature=0)
    assert full.choices[0].text == ref.text and full.object == "text_completion"
    stream = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in stream) == ref.text
    assert stream[-1].choices[0].finish_reason == "length"


def test_completions_batch_of_prompts_and_token_ids(demo, client):
    prompts = ["Once upon a time", "def fibonacci(n):"]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=demo.tokenizer.encode(prompts[1]), max_tokens=6,
                                       temperature=0)
    assert by_ids.choices[0].text == resp.choices[1].text
    assert resp.usage.prompt_tokens == sum(len(demo.tokenizer.encode(p)) for p in prompts)


def test_stop_strings_never_reach_the_client(client):
    base = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0)
    text = base.choices[0].message.content
    stop = text[10:14]
    assert len(stop.strip()) > 0
    cut = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=30, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == text[:text.index(stop)] and stop not in streamed


def test_seed_reproduces_and_n_choices_differ(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=1234, **kwargs)
    b = client.chat.completions.create(seed=1234, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = client.chat.completions.create(seed=1234, n=3, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].message.content == a.choices[0].message.content
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage.completion_tokens == 3 * 16 or any(c.finish_reason == "stop" for c in many.choices)


def test_any_integer_seed_is_a_seed(client):
    """Seeds past torch's 64-bit range are taken modulo 2**64 (OpenAI's seed is any integer; a
    JSON Schema bound near 2**63 would be compared as a float by clients and fuzzers)."""
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0)
    huge = client.chat.completions.create(seed=-(2**63) - 191, **kwargs).choices[0].message.content
    wrapped = client.chat.completions.create(seed=(-(2**63) - 191) % 2**64, **kwargs).choices[0].message.content
    assert huge == wrapped


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5
    text = resp.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace").startswith(text)


def test_extreme_penalty_with_logprobs_stays_valid_json(client):
    """Regression (found by the fuzz test): repetition_penalty=5e-324 turned logits into inf and
    logprobs into NaN, which JSON cannot carry: a 500. Now finite, floored at -9999 like OpenAI."""
    for stream in (False, True):
        resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True,
                                              top_logprobs=2, stream=stream,
                                              extra_body={"repetition_penalty": 5e-324})
        if stream:
            entries = [e for chunk in resp if chunk.choices and chunk.choices[0].logprobs
                       for e in chunk.choices[0].logprobs.content or []]
        else:
            entries = resp.choices[0].logprobs.content
        values = [e.logprob for e in entries] + [t.logprob for e in entries for t in e.top_logprobs]
        assert entries and all(-9999.0 <= v <= 0.0 for v in values), values


def test_completion_logprobs_and_echo(client):
    resp = client.completions.create(model=MODEL, prompt="Hello,", max_tokens=4, temperature=0, logprobs=2,
                                     echo=True)
    choice = resp.choices[0]
    assert choice.text.startswith("Hello,")
    assert len(choice.logprobs.tokens) == 4 and all(len(t) <= 2 for t in choice.logprobs.top_logprobs)


def test_streamed_echo_carries_the_prompt_once(client):
    # the engine sends the prompt's ids on a request's first output only: the stream must still
    # start with the prompt, once, and join to the same text as the whole response
    whole = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=6, temperature=0,
                                      echo=True).choices[0].text
    chunks = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=6, temperature=0,
                                       echo=True, stream=True)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole and whole.startswith("Hello, my name is")
    assert whole.count("Hello, my name is") == 1 and len(whole) > len("Hello, my name is")


def test_models_tokenize_detokenize(demo, server):
    with server.client() as http:
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 1024
        tok = http.post("/tokenize", json={"messages": CHAT}).json()
        assert tok["tokens"] == demo.tokenizer.encode_chat(CHAT) and tok["count"] == len(tok["tokens"])
        assert tok["max_model_len"] == 1024
        plain = http.post("/tokenize", json={"prompt": "你好，世界"}).json()
        assert plain["count"] == len(demo.tokenizer.encode("你好，世界"))
        back = http.post("/detokenize", json={"tokens": plain["tokens"]}).json()
        assert back["prompt"] == "你好，世界"


def test_usage_carries_phase_timings_and_server_timing_header(server):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
    body = r.json()
    timings = body["usage"]["brisk"]
    assert timings["ttft_ms"] > 0 and timings["e2e_ms"] >= timings["ttft_ms"]
    assert abs(timings["queue_ms"] + timings["prefill_ms"] - timings["ttft_ms"]) < 0.01
    assert "ttft;dur=" in r.headers["server-timing"]
    assert body["brisk"]["context_outcome"] == "ok" and r.headers["x-brisk-context-outcome"] == "ok"


def test_health_and_ready(server):
    with server.client() as http:
        assert http.get("/health").json() == {"status": "ok"}
        ready = http.get("/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_openai_sdk_sees_errors_as_exceptions(client):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=3)
    assert err.value.body["param"] == "temperature"


def test_http_errors_are_openai_shaped(server):
    with server.client() as http:
        r = http.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_request_log_feeds_kv_plan(demo, tmp_path):
    from brisk.trace import read_trace

    log = tmp_path / "requests.jsonl"
    with serve_engine(make_engine(demo), request_log=str(log)) as live, live.client() as http:
        for n in (3, 5):
            assert http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": n,
                                                           "ignore_eos": True}).status_code == 200
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["output_tokens"] for r in rows] == [3, 5]
    assert rows[0]["prompt_tokens"] == len(demo.tokenizer.encode_chat(CHAT)) and rows[0]["ttft_ms"] > 0
    loaded = read_trace(log)
    trace = loaded.requests
    assert loaded.skipped == 0 and [r.output_tokens for r in trace] == [3, 5] and trace[0].arrival_s == 0.0
    assert [r.max_tokens for r in trace] == [3, 5] and rows[0]["trace_version"] == 1


def test_cache_salt_separates_prefix_cache_tenants(client):
    """vLLM's cache_salt: a request reuses cached prompt blocks only when it carries the same salt
    (no salt is a salt of its own), so one tenant's prompt cannot be probed by another's timing."""
    # a long, unique prompt: several full blocks beyond anything the other tests cached
    messages = [{"role": "user", "content": "Salted prompt: " + " ".join(f"word{i}" for i in range(120))}]

    def cached(salt: str | None) -> int:
        extra = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                              extra_body=extra)
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 100  # same salt: the prompt's full blocks are reused
    assert cached("tenant-b") == 0  # another salt sees nothing
    assert cached(None) == 0  # nor does an unsalted request
    assert cached(None) >= 100


def test_greedy_text_depends_on_the_request_only(client):
    """Default flags: a greedy request 3 times alone, the first with a cold prefix cache, the others
    after another request cached its system prompt (so only its question is computed), and 3 times
    inside a batch of 16 different requests (first, in the middle, last): the same text every time. (With --no-batch-invariant
    these two questions' replies change once the system prompt is cached: the question is then a
    prompt chunk of its own rather than the end of the whole prompt's.)"""
    from concurrent.futures import ThreadPoolExecutor

    def ask(msgs, salt):
        resp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0,
                                              extra_body={"cache_salt": salt})
        return resp.choices[0].message.content

    system = {"role": "system", "content": "You are a patient tutor who answers in full sentences. Session 7c1e. " * 6}
    sibling = [system, {"role": "user", "content": "hi"}]
    for question in ["Tell me one fact about owls.", "Tell me one fact about whales."]:
        messages = [system, {"role": "user", "content": question}]
        texts = []
        for k in range(3):  # each with a cache salt of its own: a cache no other request has touched
            salt = f"{question}-alone-{k}"
            if k:
                ask(sibling, salt)  # the system prompt cached, not the question
            texts.append(ask(messages, salt))
        others = [[system if i % 2 else {"role": "system", "content": "Be brief."},
                   {"role": "user", "content": f"Say something about the number {i}." * (1 + i % 4)}]
                  for i in range(15)]
        with ThreadPoolExecutor(16) as pool:
            for k, at in enumerate((0, 7, 15)):
                salt = f"{question}-batch-{k}"
                futures = [pool.submit(ask, m, salt) for m in others[:at]] + [pool.submit(ask, messages, salt)] + \
                    [pool.submit(ask, m, salt) for m in others[at:]]
                texts.append(futures[at].result())
                for f in futures:
                    f.result()
        assert len(set(texts)) == 1, (question, texts)
