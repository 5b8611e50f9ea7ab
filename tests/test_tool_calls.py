"""Tool calls e2e with the official openai SDK: tools rendered through the chat template's
`tools` variable, replies parsed into `tool_calls` (stream and non-stream), `required` and a
named function enforced by the grammar, and a 400 naming the field where the template cannot
render tools."""

import copy
import dataclasses
import json

import jsonschema
import pytest

from brisk.server.preflight import chat_template
from brisk.structured.tools import ToolCallParser, ToolPlan, parse

from live_server import serve_engine
from engines import make_engine

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(demo):
    """The demo model with brisk's ChatML tools template (its own template has no `tools`), on a
    copy of its tokenizer: the shared `demo` keeps its own template."""
    tokenizer = copy.copy(demo.tokenizer)
    tokenizer.set_chat_template(chat_template("chatml_tools"))
    with serve_engine(make_engine(dataclasses.replace(demo, tokenizer=tokenizer))) as live:
        yield live


@pytest.fixture(scope="module")
def client(tool_server):
    return tool_server.openai()


def _schema_of(name):
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_tool_calls_are_valid(client, choice, names):
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                          temperature=0, max_tokens=120)
    choice0 = done.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    _check_calls(choice0.message.tool_calls, names)


def test_parallel_tool_calls_false_gives_exactly_one_call(client):
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=120)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_streamed_tool_calls_match_non_stream(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, content, finish, _ = _streamed_calls(client, kw)
    assert finish == "tool_calls" and content == ""
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


def test_streamed_calls_have_one_entry_per_call_per_chunk(client):
    """As OpenAI streams them: a chunk carries at most one entry per call index (a step's fragments merged
    into it), so a client that reads `delta.tool_calls[0]` of each chunk rebuilds the call, and so does the
    SDK's own accumulator (`chat.completions.stream`)."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    want = [(c.function.name, c.function.arguments) for c in whole]
    assert len(want) == 1 and len(want[0][1]) > 10
    naive, entries = {"name": "", "arguments": ""}, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            calls = c.delta.tool_calls or []
            assert len({d.index for d in calls}) == len(calls), calls
            entries += len(calls)
            if calls:  # the naive loop: the first entry only
                naive["name"] += calls[0].function.name or ""
                naive["arguments"] += calls[0].function.arguments or ""
    assert (naive["name"], naive["arguments"]) == want[0] and entries >= 3
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in final] == want


def test_auto_returns_content_or_valid_calls(client):
    for stream in (False, True):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=80)
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]
            calls, content, finish = choice.message.tool_calls, choice.message.content, choice.finish_reason
        else:
            content, finish, calls = "", None, []
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    content += c.delta.content or ""
                    finish = c.finish_reason or finish
                    calls += c.delta.tool_calls or []
        if calls:
            assert finish == "tool_calls"
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))
        else:
            assert content and finish in ("stop", "length") and "<tool_call>" not in content.split("</tool_call>")[-1]


def test_tool_results_go_back_through_the_template(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120).choices[0].message
    call = first.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    done = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=20)
    assert done.choices[0].message.content and not done.choices[0].message.tool_calls
    assert done.usage.prompt_tokens > 60  # the tools, the call and its result were all rendered


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
])
def test_bad_tool_requests_are_400(tool_server, body, param):
    with tool_server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_template_without_tools_is_400_naming_the_field(demo):
    assert "tools" not in demo.tokenizer.template_variables  # SmolLM2's own template
    with serve_engine(make_engine(demo)) as live, live.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "--chat-template" in error["message"]


# -- the parsers, on replies written by hand ---------------------------------------------
HERMES = ToolPlan(TOOLS, "auto", None, True, "hermes")
JSON_STYLE = ToolPlan(TOOLS, "auto", None, True, "json")
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, names", [
    ("Just text.", "Just text.", []),
    (CALL, None, ["get_time"]),
    ("Let me check. " + CALL + "\n" + CALL.replace("UTC", "CET"), "Let me check.", ["get_time", "get_time"]),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ("<tool_call>{broken", "<tool_call>{broken", []),
])
def test_hermes_parse(text, content, names):
    got_content, calls = parse(text, HERMES)
    assert got_content == content and [c["function"]["name"] for c in calls] == names


@pytest.mark.parametrize("text, content, names", [
    ('{"name": "get_time", "parameters": {"timezone": "UTC"}}', None, ["get_time"]),
    ('[{"name": "get_time", "arguments": {"timezone": "UTC"}}, {"name": "get_weather", "arguments": '
     '{"city": "Oslo", "unit": "celsius"}}]', None, ["get_time", "get_weather"]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("Plain words.", "Plain words.", []),
])
def test_json_style_parse(text, content, names):
    got_content, calls = parse(text, JSON_STYLE)
    assert got_content == content and [c["function"]["name"] for c in calls] == names


def test_one_call_only_without_parallel_calls():
    single = ToolPlan(TOOLS, "auto", None, False, "hermes")
    content, calls = parse(CALL + "\n" + CALL.replace("UTC", "CET"), single)
    assert len(calls) == 1 and content == "\n" + CALL.replace("UTC", "CET")  # the second stays text: nothing dropped
    content, calls = parse('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]',
                           ToolPlan(TOOLS, "auto", None, False, "json"))
    assert [c["function"]["name"] for c in calls] == ["get_time"] and content.startswith(", {")


def _streamed(plan, pieces):
    """(content, {index: name and arguments}) as a client's stream accumulator rebuilds them."""
    parser, content, calls = ToolCallParser(plan), "", {}
    for piece in [*pieces, None]:
        sent, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content += sent
        for d in deltas:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.name or ""
            entry["arguments"] += d.arguments
    return content, calls


def test_streaming_parser_sends_text_then_the_call_in_fragments():
    pieces = ["Let me ", "check. <tool", "_call>\n{\"name\": ", '"get_time", ', '"arguments": {"timezone": ',
              '"UTC"}}\n</tool_call>']
    parser, fragments = ToolCallParser(HERMES), []
    for piece in pieces:
        fragments.append(parser.feed(piece))
    assert fragments[0] == ("Let me", []) and fragments[1][0] == " check."
    starts = [d for _, deltas in fragments for d in deltas if d.name]
    args = [d.arguments for _, deltas in fragments for d in deltas if not d.name]
    assert [d.name for d in starts] == ["get_time"] and len(args) >= 2  # id and name first, then fragments
    assert "".join(args) == '{"timezone": "UTC"}'


@pytest.mark.parametrize("plan, text", [
    (HERMES, "Hi. " + CALL + " then <tool_call>{broken</tool_call>" + CALL.replace("UTC", "CET") + " bye"),
    (HERMES, "a <b and <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call> c"),
    (JSON_STYLE, '<|python_tag|>{"name": "get_time", "parameters": {"timezone": "UTC"}}; '
                 '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'),
    (ToolPlan(TOOLS, "auto", None, True, "mistral"), 'Sure. [TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}'),
    (ToolPlan(TOOLS, "auto", None, True, "mistral"), '[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": '
                                                     '"UTC"}}, {"name": "get_time", "arguments": {"timezone": "CET"}}]'),
])
def test_streamed_and_whole_replies_agree_at_any_split(plan, text):
    content, calls = parse(text, plan)
    for size in (1, 2, 7, len(text)):
        streamed, streamed_calls = _streamed(plan, [text[i:i + size] for i in range(0, len(text), size)])
        assert (streamed or None) == content
        assert [streamed_calls[i] for i in sorted(streamed_calls)] == \
            [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


def test_an_immediate_repeat_of_a_call_is_left_out():
    parser = ToolCallParser(HERMES)
    parser.feed(CALL + "\n" + CALL + "\n" + CALL.replace("UTC", "CET"))
    parser.finish()
    assert [c.arguments for c in parser.calls] == ['{"timezone": "UTC"}', '{"timezone": "CET"}'] and parser.repeated


def test_a_call_cut_by_the_token_limit_is_a_call_not_content():
    parser = ToolCallParser(HERMES)
    content, _ = parser.feed("Checking. " + CALL[:45])
    content2, _ = parser.finish()
    assert content + content2 == "Checking." and parser.cut
    assert [c.name for c in parser.calls] == ["get_time"] and not parser.calls[0].complete


# -- issue 37: 20 forced calls that parse, validate and stream in fragments ---------------------------
TIME_OPEN = {"type": "function", "function": {  # no additionalProperties: strict mode closes it
    "name": "get_time", "description": "Current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
BOOKING = {"type": "function", "function": {  # what pydantic writes: $defs and $ref
    "name": "book_room", "description": "Book a hotel room",
    "parameters": {"$defs": {"Stay": {"type": "object", "properties": {"nights": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 9},
                                                                       "city": {"type": "string", "maxLength": 16}},
                                      "required": ["nights", "city"]}},
                   "type": "object", "properties": {"stay": {"$ref": "#/$defs/Stay"}}, "required": ["stay"]}}}
FORCED_TOOLS = {"closed": [WEATHER, TIME], "open": [TIME_OPEN, WEATHER], "refs": [BOOKING, TIME_OPEN]}
FORCED = [(kind, choice, parallel, stream)
          for kind in ("closed", "open") for choice in ("required", "named")
          for parallel in (True, False) for stream in (False, True)] + \
         [("refs", choice, True, stream) for choice in ("required", "named") for stream in (False, True)]
assert len(FORCED) == 20


def _forced_kwargs(kind, choice, parallel):
    tools = FORCED_TOOLS[kind]
    tool_choice = "required" if choice == "required" else {"type": "function",
                                                           "function": {"name": tools[0]["function"]["name"]}}
    ask = {"closed": ASK, "open": [{"role": "user", "content": "What time is it in Paris?"}],
           "refs": [{"role": "user", "content": "Book me two nights in Rome."}]}[kind]
    return dict(model=MODEL, messages=ask, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel,
                temperature=0, max_tokens=160)


def _streamed_calls(client, kw):
    calls, content, finish, fragments = {}, "", None, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                if d.function.arguments:
                    entry["arguments"] += d.function.arguments
                    fragments[d.index] = fragments.get(d.index, 0) + 1
    return [calls[i] for i in sorted(calls)], content, finish, fragments


@pytest.mark.parametrize("kind, choice, parallel, stream", FORCED)
def test_forced_calls_parse_validate_and_stream_in_fragments(client, kind, choice, parallel, stream):
    kw = _forced_kwargs(kind, choice, parallel)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in kw["tools"]}
    whole = client.chat.completions.create(**kw).choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
    content, finish = whole.message.content, whole.finish_reason
    if stream:
        streamed, content, finish, fragments = _streamed_calls(client, kw)
        assert streamed == calls, "streamed calls differ from the whole reply's"
        assert all(fragments.get(i, 0) >= 2 for i in range(len(calls))), fragments
    assert "<tool_call>" not in (content or "")  # never half a call in content
    assert finish in ("tool_calls", "length"), finish
    assert calls, "a forced call produced no call"
    if not parallel:
        assert len(calls) == 1
    for i, call in enumerate(calls):
        if finish == "length" and i == len(calls) - 1:
            continue  # cut by max_tokens: reported as such
        if choice == "named":
            assert call["name"] == kw["tools"][0]["function"]["name"]
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    assert all(a != b for a, b in zip(calls, calls[1:])), "an immediate repeat of a call"


def test_a_forced_call_can_add_no_property_its_schema_does_not_declare(demo):
    """OpenAI's strict mode: after the declared properties the arguments object can only close (the
    open schema let a small model invent properties until max_tokens)."""
    from brisk.structured.bitmask import allowed_tokens
    from brisk.structured.compiler import GrammarCompiler
    from brisk.structured.tools import ToolPlan, grammar

    tok = demo.tokenizer
    compiler = GrammarCompiler(tok.fast, demo.config.vocab_size, tok.eos_token_ids)
    try:
        matcher = compiler.compile(grammar(ToolPlan([TIME_OPEN], "function", "get_time", False, "hermes"))).matcher()
        prefix = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"'
        for token in tok.encode(prefix, add_special_tokens=False):
            assert matcher.consume_token(token)
        allowed = allowed_tokens(matcher, demo.config.vocab_size).nonzero().flatten().tolist()
        texts = {tok.fast.decode([t]) for t in allowed}
        assert texts and all(t.startswith("}") for t in texts), texts  # no ",", and no free whitespace either
    finally:
        compiler.close()
