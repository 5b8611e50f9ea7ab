"""OpenAI's Responses API (`POST /v1/responses`, brisk/server/responses_api.py) against clients nobody here
wrote: the official `openai` SDK (create, stream with its typed events, parse with a pydantic model, a
function-call round trip, previous_response_id and retrieve) and the OpenAI Agents SDK running an agent with
a function tool; the event sequence for reasoning, text and calls on hand-written replies; the fields it
refuses; `reasoning_effort` on chat."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from types import SimpleNamespace

import httpx
import pytest
from pydantic import BaseModel

from brisk.engine.outputs import RequestOutput
from brisk.server.preflight import chat_template
from brisk.server.responses_api import ResponsesFormatter, ResponsesRequest, ResponseStore
from brisk.server.state import ServerConfig
from brisk.structured.tools import ToolPlan
from engines import make_engine
from live_server import serve_engine
from llamacpp import llamacpp_dir

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
SHORT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}


@pytest.fixture(scope="module")
def server(demo):
    """The demo model behind brisk's ChatML tools template, with an API key (the Responses route is behind it)."""
    tokenizer = copy.copy(demo.tokenizer)
    tokenizer.set_chat_template(chat_template("chatml_tools"))
    with serve_engine(make_engine(dataclasses.replace(demo, tokenizer=tokenizer)), api_key="sekrit") as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return server.openai(api_key="sekrit")


def test_create_answers_with_a_message_and_usage(client):
    r = client.responses.create(model=MODEL, input="Is Paris in France?", text=SHORT, temperature=0,
                                max_output_tokens=40)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == "completed"
    assert json.loads(r.output_text)["answer"] in ("yes", "no")
    assert r.usage.input_tokens > 5 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.model_extra["brisk"]["ttft_ms"] > 0  # brisk's timings, as on chat


def test_a_cut_reply_is_incomplete_with_its_reason(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def test_stream_sends_the_typed_events_in_order_and_the_same_text(client):
    kw = dict(model=MODEL, input="Is Paris in France?", text=SHORT, temperature=0, max_output_tokens=40)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert all(type(e).__name__ == "Response" + "".join(p.title() for p in e.type.split(".")[1].split("_")) + "Event"
               or type(e).__name__.endswith("Event") for e in events)  # every event parsed into the SDK's own type
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    completed = events[-1].response
    assert completed.output_text == whole.output_text and completed.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**kw) as stream:  # the SDK's own accumulator
        assert stream.get_final_response().output_text == whole.output_text


def test_parse_gives_a_pydantic_object(client):
    class City(BaseModel):
        name: str
        population: int

    parsed = client.responses.parse(model=MODEL, input="Name a big city.", text_format=City, temperature=0,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_a_function_call_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required", temperature=0,
                                    max_output_tokens=60)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert json.loads(calls[0].arguments)["city"]
    streamed = list(client.responses.create(stream=True, model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                            temperature=0, max_output_tokens=60))
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == calls[0].arguments
    follow = client.responses.create(model=MODEL, input=ask + [calls[0].model_dump(exclude_none=True)] + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
        tools=[WEATHER], temperature=0, max_output_tokens=20)
    assert follow.status in ("completed", "incomplete") and follow.output


def test_previous_response_id_continues_a_stored_response(client, server):
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=8)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=8)
    assert second.previous_response_id == first.id
    # the stored conversation went in: more prompt tokens than the question alone
    alone = client.responses.create(model=MODEL, input="What is my name?", temperature=0, max_output_tokens=8,
                                    store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with server.client(headers={"Authorization": "Bearer sekrit"}) as http:
        assert http.get(f"/v1/responses/{alone.id}").status_code == 404  # store: false kept nothing
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tamperature": 0.5}, "tamperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_brisk_does_not_run_is_a_400_naming_the_field(server, body, param):
    with server.client(headers={"Authorization": "Bearer sekrit"}) as http:
        r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") + error["message"], error


def test_the_route_needs_the_api_key_and_is_in_the_openapi_document(server):
    with server.client() as http:
        assert http.post("/v1/responses", json={"model": MODEL, "input": "hi"}).status_code == 401
        spec = http.get("/openapi.json", headers={"Authorization": "Bearer sekrit"}).json()
    assert "/v1/responses" in spec["paths"]


def test_an_agents_sdk_agent_calls_its_function_tool(server):
    """The OpenAI Agents SDK (openai-agents) against brisk's Responses API: an agent with one function tool,
    the call forced on its first turn; the tool runs with the model's arguments and its result is the answer."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        seen.append(city)
        return f"sunny in {city}"

    model = OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=f"{server.url}/v1", api_key="sekrit",
                                                                        max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(seen) == 1 and seen[0] and result.final_output == f"sunny in {seen[0]}"


# -- the event sequence on hand-written replies -------------------------------------------------------------------
@pytest.fixture(scope="module")
def state(demo):
    """What a formatter reads of the server's state: its config, the tokenizer and the response store."""
    return SimpleNamespace(config=ServerConfig(), tokenizer=demo.tokenizer, responses=ResponseStore())


def _formatter(state, demo, tools=None, reasoning="qwen3", **body):
    return ResponsesFormatter("resp_test", state, ResponsesRequest.model_validate({"input": "x", **body}), tools,
                              reasoning, [])


def _outputs(pieces: list[str], finish: str = "stop") -> list[RequestOutput]:
    return [RequestOutput("r", None, [], "", [], piece, [1], i == len(pieces) - 1,
                          finish if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]


def _anonymous(items: list[dict]) -> list[dict]:
    """Output items without their ids (each formatter draws its own)."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


PLAN = ToolPlan([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
                "auto", None, True, "hermes")
TRANSCRIPTS = {
    "thinking then answer": (["<think>", "Let me", " see.</think>", "It is", " 4."], None),
    "answer only": (["It is", " 4."], None),
    "thinking then a call": (["<think>need weather</think>", '<tool_call>{"name": "get_weather", ',
                              '"arguments": {"city": "Paris"}}</tool_call>'], PLAN),
    "text then two calls": (["Checking. ", '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>',
                             '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>'], PLAN),
    # gpt-oss's harmony channels, read by its parser (the stop token, <|return|> or <|call|>, is not in the text)
    "harmony thinking then answer": (["<|channel|>analysis<|message|>", "Let me", " see.<|end|>",
                                      "<|start|>assistant<|channel|>final<|message|>It is", " 4."], None),
    "harmony thinking then a call": (["<|channel|>analysis<|message|>need weather<|end|><|start|>assistant",
                                      "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
                                      '{"city": ', '"Paris"}'], PLAN),
}


@pytest.mark.parametrize("name", sorted(TRANSCRIPTS))
@pytest.mark.parametrize("cut", [False, True])
def test_events_and_the_whole_response_agree_on_every_channel_mix(state, demo, name, cut):
    """Reasoning, text and calls, each item opened (added), filled (deltas) and closed (done) in order, ids kept
    from added to done; a reply cut by max_output_tokens closes its open items as incomplete. The streamed
    events rebuild exactly the non-streamed response's output."""
    pieces, tools = TRANSCRIPTS[name]
    if cut:
        pieces = pieces[:-1]
    parser = "gpt-oss" if name.startswith("harmony") else "qwen3"
    streamed, whole = _formatter(state, demo, tools, parser), _formatter(state, demo, tools, parser)
    events = streamed.first_chunks([], [])
    for out in _outputs(pieces, "length" if cut else "stop"):
        events += streamed.chunks(0, out, None)
        whole.observe(0, out)
    usage = {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 3 + len(pieces),
             "prompt_tokens_details": {"cached_tokens": 0}}
    events += streamed.last_chunks(None, usage)
    final = whole.full_response({}, [], [], usage)
    assert events[-1]["type"] == ("response.incomplete" if cut else "response.completed")
    assert _anonymous(events[-1]["response"]["output"]) == _anonymous(final["output"])
    items: dict[int, dict] = {}
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] not in items
            items[e["output_index"]] = json.loads(json.dumps(e["item"]))
        elif e["type"] == "response.output_item.done":
            assert e["item"]["id"] == items[e["output_index"]]["id"]
            assert _anonymous([e["item"]]) == _anonymous([final["output"][e["output_index"]]])
            assert e["item"]["status"] == ("incomplete" if cut and e["output_index"] == len(final["output"]) - 1
                                           else "completed")
        elif e["type"].endswith(".delta"):
            assert e["item_id"] == items[e["output_index"]]["id"]
    kinds = [o["type"] for o in final["output"]]
    if "thinking" in name:
        assert kinds[0] == "reasoning" and final["output"][0]["content"][0]["text"]
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
            final["output"][0]["content"][0]["text"]
    if not cut and "call" in name:
        calls = [o for o in final["output"] if o["type"] == "function_call"]
        assert calls and all(json.loads(c["arguments"])["city"] for c in calls)
        assert len(calls) == (2 if "two" in name else 1)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# -- reasoning_effort on chat --------------------------------------------------------------------------------------
def test_reasoning_effort_reaches_templates_that_read_it(demo):
    qwen3 = copy.copy(demo.tokenizer)
    qwen3.set_chat_template((llamacpp_dir() / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text())
    with serve_engine(make_engine(dataclasses.replace(demo, tokenizer=qwen3))) as live, live.client() as http:
        counts = {effort: http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "reasoning_effort": effort}).json()["count"]
                  for effort in ("minimal", "high")}
        assert counts["minimal"] > counts["high"]  # enable_thinking false: the template closes an empty <think></think>
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                    "reasoning_effort": "minimal"})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == counts["minimal"]


def test_reasoning_effort_on_a_template_that_cannot_honour_it_is_a_400(server):
    with server.client(headers={"Authorization": "Bearer sekrit"}) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                    "reasoning_effort": "high", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    assert "reads neither" in r.json()["error"]["message"]
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sekrit"}) as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "reasoning": {"effort": "low"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
