"""Structured outputs e2e with the official openai SDK: every reply parses and validates against
its schema with `jsonschema` (a validator nobody here wrote), streamed or not, batched with
unconstrained requests whose greedy output must not change."""

import concurrent.futures as cf
import json
import re

import jsonschema
import pytest
import torch

from brisk.engine.request import Request
from brisk.engine.sampler import Sampler
from brisk.engine.sampling_params import SamplingParams
from brisk.errors import ParamError
from brisk.structured.bitmask import allowed_tokens
from brisk.structured.compiler import GrammarCompiler, GrammarError
from brisk.structured.spec import GrammarSpec, choice_spec, json_spec

from live_server import serve_engine
from structured_schemas import SCHEMAS
from engines import make_engine

MODEL = "smollm2-135m-instruct"
FREE = [[{"role": "user", "content": q}] for q in ("Name three rivers in Europe.", "What is 2+2?",
                                                   "Write a haiku about rain.", "Say hello in French.")]


@pytest.fixture(scope="module")
def server(demo):
    # the demo's int4 weights with default flags: greedy output is batch-invariant
    # (tests/test_engine_batching.py), so "unchanged by the grammars in its batch" is exact
    with serve_engine(make_engine(demo)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def grammars(demo):
    tok = demo.tokenizer
    return GrammarCompiler(tok.fast, demo.config.vocab_size, tok.eos_token_ids)


def _ask(client, messages, stream=False, **kw):
    """(text, finish_reason) of a greedy chat completion, streamed or not."""
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=kw.pop("max_tokens", 200), **kw)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _schema_format(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_twenty_schemas_validate_batched_with_unconstrained_requests(client, stream):
    alone = [_ask(client, m, max_tokens=24) for m in FREE]  # each request on its own first
    with cf.ThreadPoolExecutor(len(SCHEMAS) + len(FREE)) as pool:
        constrained = [pool.submit(_ask, client, [{"role": "user", "content": f"Give an example {name} as JSON."}],
                                   stream, response_format=_schema_format(name, schema))
                       for name, schema in SCHEMAS]
        free = [pool.submit(_ask, client, m, stream, max_tokens=24) for m in FREE]
        for (name, schema), future in zip(SCHEMAS, constrained):
            text, finish = future.result()
            assert finish == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema)
        # the same greedy text as alone: a grammar in the batch leaves other rows untouched
        assert [f.result() for f in free] == alone


def test_json_object_mode_on_chat_and_completions(client):
    text, finish = _ask(client, [{"role": "user", "content": "Describe a cat."}],
                        response_format={"type": "json_object"}, max_tokens=120)
    assert finish == "stop" and isinstance(json.loads(text), dict)
    done = client.completions.create(model=MODEL, prompt="A JSON object describing a dog:", max_tokens=120,
                                     temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert done.choices[0].finish_reason == "stop" and isinstance(json.loads(done.choices[0].text), dict)


def test_vllm_guided_extras(client):
    def ask(**extra):
        return _ask(client, [{"role": "user", "content": "Answer me."}], max_tokens=40, extra_body=extra)

    text, _ = ask(guided_choice=["yes", "no", 'say "maybe"'])
    assert text in ("yes", "no", 'say "maybe"')
    text, _ = ask(guided_regex=r"[0-9]{3}-[a-z]{2}")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)
    schema = SCHEMAS[0][1]
    text, _ = ask(guided_json=schema)
    jsonschema.validate(json.loads(text), schema)
    text, _ = ask(guided_grammar='start: "red" | "green" | "blue"')
    assert text in ("red", "green", "blue")
    text, _ = ask(guided_grammar='root ::= ("up" | "down") " " [0-9]')  # GBNF, as llama.cpp takes it
    assert re.fullmatch(r"(up|down) [0-9]", text)
    text, _ = ask(structured_outputs={"choice": ["left", "right"]})
    assert text in ("left", "right")
    text, _ = ask(guided_json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                               "additionalProperties": False},
                  guided_whitespace_pattern=r"\n")
    assert json.loads(text).keys() == {"a"} and text.startswith("{\n")


def test_n_choices_each_follow_the_grammar(client):
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick."}], n=3,
                                          temperature=1.0, seed=7, max_tokens=10,
                                          extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert len(done.choices) == 3 and all(c.message.content in ("alpha", "beta", "gamma") for c in done.choices)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frog"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_bad_grammar_requests_are_400_naming_the_field(server, body, param):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": FREE[0], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("functions", [{"name": "f"}]),
    ("function_call", "auto"), ("min_tokens", 3), ("use_beam_search", True), ("chat_template", "{{ x }}"),
    ("reasoning_effort", "low"), ("some_future_field", 1),
])
def test_unsupported_fields_are_refused_by_name(server, field, value):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": FREE[0], "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")


@pytest.mark.parametrize("field, value", [("suffix", "end"), ("best_of", 2), ("tools", [])])
def test_unsupported_completions_fields_are_refused(server, field, value):
    with server.client() as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_image_and_audio_parts_are_refused(server):
    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                 {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}):
        with server.client() as http:
            r = http.post("/v1/chat/completions", json={
                "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]})
        assert r.status_code == 400, r.text
        assert part["type"] in r.json()["error"]["message"] and "text-only" in r.json()["error"]["message"]


def test_cosmetic_fields_pass(server):
    from brisk.server.protocol import COSMETIC, ChatCompletionRequest, CompletionRequest

    assert set(COSMETIC) <= set(ChatCompletionRequest.model_fields) & set(CompletionRequest.model_fields)
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={
            "messages": FREE[0], "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto", "prompt_cache_key": "k"})
    assert r.status_code == 200, r.text


def test_logit_bias_is_applied(demo, client):
    messages = FREE[1]
    base = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=1,
                                          logprobs=True, top_logprobs=2)
    first = demo.tokenizer.encode(base.choices[0].logprobs.content[0].token, add_special_tokens=False)
    assert len(first) == 1
    banned = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=1,
                                            logit_bias={str(first[0]): -100})
    assert banned.choices[0].message.content != base.choices[0].message.content
    forced_id = demo.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=1,
                                            logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == demo.tokenizer.decode([forced_id])


@pytest.mark.parametrize("bias, fragment", [({"abc": 1}, "not a token id"), ({"999999": 1}, "outside the vocabulary"),
                                           ({"5": 101}, "less than or equal to 100")])
def test_bad_logit_bias_is_400(server, bias, fragment):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": FREE[0], "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


# -- units -------------------------------------------------------------------------------
def test_sampler_masks_only_rows_with_a_grammar(demo, grammars):
    vocab = demo.config.vocab_size
    compiled = grammars.compile(choice_spec(["yes", "no"], "guided_choice"))
    free = Request("free", [1], SamplingParams(temperature=0))
    bound = Request("bound", [1], SamplingParams(temperature=0))
    bound.grammar = compiled.matcher()
    logits = torch.randn(2, vocab)
    original = logits.clone()
    out = Sampler(torch.device("cpu"), eos_token_ids=demo.tokenizer.eos_token_ids)(logits, [free, bound])
    assert torch.equal(logits[0], original[0])  # the unconstrained row is untouched
    allowed = allowed_tokens(compiled.matcher(), vocab)
    assert torch.equal(torch.isfinite(logits[1]), allowed)
    assert 0 < int(allowed.sum()) < vocab and bool(allowed[out.token_ids[1]])
    assert out.token_ids[0] == original[0].argmax()


def test_compiled_grammars_are_cached_and_matchers_independent(grammars):
    spec = json_spec({"type": "object", "properties": {"a": {"type": "integer"}}}, "guided_json")
    first = grammars.compile(spec)
    assert grammars.compile(json_spec({"type": "object", "properties": {"a": {"type": "integer"}}}, "x")) is first
    one, two = first.matcher(), first.matcher()
    token = next(t for t in range(grammars.vocab_size) if allowed_tokens(one, grammars.vocab_size)[t])
    assert one.consume_token(token)
    assert not torch.equal(allowed_tokens(one, grammars.vocab_size), allowed_tokens(two, grammars.vocab_size))


def test_grammar_errors_name_their_field(grammars):
    with pytest.raises(GrammarError) as e:
        grammars.compile(GrammarSpec("regex", "(unclosed", "guided_regex"))
    assert e.value.field == "guided_regex"
    with pytest.raises(ParamError) as e:
        json_spec("[1, 2", "guided_json")
    assert e.value.field == "guided_json"
