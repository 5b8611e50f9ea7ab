"""The harmony parser (gpt-oss replies) on hand-written transcripts of every channel mix, whole and streamed,
cut by max_tokens inside each part, and on replies rendered by gpt-oss's own chat template (llama.cpp's
models/templates/openai-gpt-oss-120b.jinja, from the test material `make` fetches)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from brisk.structured.harmony import HarmonyParser
from brisk.structured.tools import merged

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. I should call get_weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris", "unit": "celsius"}<|call|>')
CALL_RECIPIENT_FIRST = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
                        '{"zone": "CET"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 21 °C and sunny in Paris.<|return|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check that for you.<|end|>"
BROWSER = ('<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"query": "Paris weather"}<|call|>')

# (reply, reasoning, content, [(name, arguments)])
TRANSCRIPTS = {
    "analysis-final": (ANALYSIS + FINAL, "The user wants the weather. I should call get_weather.",
                       "It is 21 °C and sunny in Paris.", []),
    "final-only": ("<|channel|>final<|message|>Hello!<|return|>", "", "Hello!", []),
    "analysis-call": (ANALYSIS + CALL, "The user wants the weather. I should call get_weather.", "",
                      [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "call-recipient-before-channel": (CALL_RECIPIENT_FIRST.removeprefix("<|start|>assistant"), "", "",
                                      [("get_time", '{"zone": "CET"}')]),
    "preamble-then-call": ("<|channel|>commentary<|message|>Let me check that for you.<|end|>" + CALL, "",
                           "Let me check that for you.", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "two-calls": (ANALYSIS + CALL + CALL_RECIPIENT_FIRST, "The user wants the weather. I should call get_weather.",
                  "", [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')]),
    "builtin-tool-is-reasoning": (ANALYSIS + BROWSER + FINAL,
                                  'The user wants the weather. I should call get_weather.{"query": "Paris weather"}',
                                  "It is 21 °C and sunny in Paris.", []),
    "stop-tokens-not-in-text": ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
                                "<|message|>Done.", "Think.", "Done.", []),
    "no-harmony-at-all": ("Just an answer, no format.", "", "Just an answer, no format.", []),
    "markup-lookalikes-in-text": ("<|channel|>final<|message|>Use <|en or <b> tags; a < b.<|return|>", "",
                                  "Use <|en or <b> tags; a < b.", []),
    "empty": ("", "", "", []),
}


def _whole(reply: str) -> HarmonyParser:
    parser = HarmonyParser()
    parser.feed(reply)
    parser.finish()
    return parser


def _streamed(reply: str, pieces: list[str]) -> tuple[HarmonyParser, str, str, list]:
    """The parser fed piece by piece, and what its steps released, joined."""
    parser, reasoning, content, deltas = HarmonyParser(), [], [], []
    for piece in pieces + [None]:
        step = parser.feed(piece) if piece is not None else parser.finish()
        reasoning.append(step.reasoning)
        content.append(step.content)
        deltas.extend(step.tool_calls)
    return parser, "".join(reasoning), "".join(content), deltas


def _chunks(text: str, rng: random.Random) -> list[str]:
    out, at = [], 0
    while at < len(text):
        n = rng.randint(1, 9)
        out.append(text[at:at + n])
        at += n
    return out


@pytest.mark.parametrize("name", list(TRANSCRIPTS))
def test_each_channel_mix_is_read_into_reasoning_content_and_calls(name):
    reply, reasoning, content, calls = TRANSCRIPTS[name]
    parser = _whole(reply)
    assert (parser.reasoning, parser.content) == (reasoning, content)
    assert [(c.name, c.arguments) for c in parser.calls] == calls
    assert all(c.complete for c in parser.calls) and not parser.cut
    for call in parser.calls:
        json.loads(call.arguments)
        assert call.id.startswith("call_")


@pytest.mark.parametrize("name", list(TRANSCRIPTS))
def test_streamed_in_any_pieces_it_releases_what_the_whole_reply_gives(name):
    """Character by character and in random pieces: the released reasoning and content are the whole reply's,
    and the call deltas rebuild its calls (a call's id and name first, then its arguments in fragments)."""
    reply, reasoning, content, calls = TRANSCRIPTS[name]
    rng = random.Random(7)
    for pieces in [list(reply), _chunks(reply, rng), _chunks(reply, rng), [reply]]:
        parser, got_reasoning, got_content, deltas = _streamed(reply, pieces)
        assert (got_reasoning, got_content) == (reasoning, content), pieces
        rebuilt: dict[int, list[str]] = {}
        for d in merged(deltas):
            if d.id is not None:
                assert d.index == len(rebuilt) and d.name
                rebuilt[d.index] = [d.name, d.arguments]
            else:
                rebuilt[d.index][1] += d.arguments
        assert [tuple(v) for v in rebuilt.values()] == calls
        assert [c.id for c in parser.calls] == [d.id for d in deltas if d.id is not None]


def test_markup_is_never_released_as_text():
    """While a body's text could be the start of `<|end|>`, `<|call|>` or `<|return|>`, it is held."""
    parser = HarmonyParser()
    released = [parser.feed(piece).content for piece in ["<|channel|>final<|message|>Hi", "<|", "en", "d|>"]]
    assert released == ["Hi", "", "", ""] and parser.content == "Hi"


@pytest.mark.parametrize("cut_in", ["analysis", "final", "call-arguments", "header", "commentary-preamble"])
def test_a_reply_cut_by_max_tokens_keeps_what_it_has(cut_in):
    """Cut inside a body: its text so far goes where the body was going (a call's partial arguments stay a call,
    marked cut); cut inside a header: nothing of it is text."""
    full = ANALYSIS + PREAMBLE + CALL
    cut_at = {
        "analysis": full.index("I should"),
        "commentary-preamble": full.index("check that"),
        "call-arguments": full.index('"unit"'),
        "header": full.index("to=functions.get_weather") + 5,
        "final": None,
    }[cut_in]
    if cut_in == "final":
        reply = ANALYSIS + FINAL
        reply = reply[:reply.index("sunny")]
    else:
        reply = full[:cut_at]
    for pieces in ([reply], list(reply)):
        parser, reasoning, content, deltas = _streamed(reply, pieces)
        assert (reasoning, content) == (parser.reasoning, parser.content)
        if cut_in == "analysis":
            assert parser.reasoning == "The user wants the weather. " and not parser.content and not parser.calls
        elif cut_in == "final":
            assert parser.reasoning.endswith("get_weather.") and parser.content == "It is 21 °C and "
        elif cut_in == "commentary-preamble":
            assert parser.content == "Let me " and not parser.calls
        elif cut_in == "call-arguments":
            assert parser.cut and [(c.name, c.arguments, c.complete) for c in parser.calls] == [
                ("get_weather", '{"city": "Paris", ', False)]
            assert parser.content == "Let me check that for you."
        else:
            assert not parser.calls and not parser.cut and parser.content == "Let me check that for you."


TEMPLATE = Path(__file__).resolve().parent.parent / ".venv" / "llama.cpp" / "models" / "templates" / \
    "openai-gpt-oss-120b.jinja"


@pytest.fixture(scope="module")
def gpt_oss_template():
    if not TEMPLATE.exists():
        pytest.fail(f"{TEMPLATE} is missing: `make setup` fetches llama.cpp's test material")
    from brisk.tokenizer import compile_chat_template

    return compile_chat_template(TEMPLATE.read_text())


def test_replies_rendered_by_gpt_oss_own_template_parse_back(gpt_oss_template):
    """gpt-oss's template renders an assistant turn as the model is trained to write it: what follows the
    generation prompt parses back into that turn's reasoning, content and call."""
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    prompt = gpt_oss_template.render(messages=user, tools=tools, add_generation_prompt=True)
    assert prompt.endswith("<|start|>assistant")
    turns = [
        ({"role": "assistant", "thinking": "Need the weather tool.",
          "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         ("Need the weather tool.", "", [("get_weather", {"city": "Paris"})])),
        ({"role": "assistant", "thinking": "Easy.", "content": "Sunny, 21 °C."}, ("Easy.", "Sunny, 21 °C.", [])),
    ]
    for turn, (reasoning, content, calls) in turns:
        if "tool_calls" in turn:  # a call turn is followed by its tool's answer in a conversation
            messages = user + [turn, {"role": "tool", "content": "sunny"}]
        else:
            messages = user + [turn]
        whole = gpt_oss_template.render(messages=messages, tools=tools, add_generation_prompt=False)
        assert whole.startswith(prompt)
        reply = whole[len(prompt):]
        if "tool_calls" in turn:
            reply = reply[:reply.index("<|call|>") + len("<|call|>")]
        parser = _whole(reply)
        assert (parser.reasoning, parser.content) == (reasoning, content), reply
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls, reply


# -- forced calls in harmony's own syntax ------------------------------------------------------------------
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
           {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def harmony_compiler(demo):
    """The demo's vocabulary with harmony's markers added as special tokens, as gpt-oss's tokenizer has them."""
    from tokenizers import AddedToken, Tokenizer

    from brisk.structured.compiler import GrammarCompiler

    fast = Tokenizer.from_str(demo.tokenizer.fast.to_str())
    fast.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    compiler = GrammarCompiler(fast, 49152 + len(MARKERS), demo.tokenizer.eos_token_ids)
    yield fast, compiler, demo.tokenizer.fast
    compiler.close()


def _accepts(compiler, spec, fast, pieces) -> bool:
    """Whether the grammar takes these pieces in order (a marker as its token, text as `fast` splits it: the
    demo's own tokenizer spells the markers as text) and is then complete."""
    matcher = compiler.compile(spec).matcher()
    for piece in pieces:
        ids = [fast.token_to_id(piece)] if piece in MARKERS else fast.encode(piece, add_special_tokens=False).ids
        for token in ids:
            if not matcher.consume_token(token):
                return False
    return matcher.is_accepting()


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_forced_call_is_one_harmony_call_with_the_markers_as_tokens(harmony_compiler, choice):
    """tool_choice required (or a named function) forces a call in harmony's syntax, an analysis message allowed
    first; the markers must be the special tokens themselves: the same characters spelled as text are refused,
    as are arguments outside the schema and a function the choice does not name."""
    from brisk.structured.harmony import call_grammar
    from brisk.structured.tools import ToolPlan

    fast, compiler, as_text = harmony_compiler
    plan = ToolPlan(WEATHER, "function" if choice != "required" else "required",
                    None if choice == "required" else choice, True, "hermes")
    spec = call_grammar(plan, set(MARKERS))
    call = ["<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json", "<|message|>",
            '{"city": "Paris"}', "<|call|>"]
    thought = ["<|channel|>", "analysis", "<|message|>", "They want the weather.", "<|end|>", "<|start|>", "assistant"]
    assert _accepts(compiler, spec, fast, call)
    assert _accepts(compiler, spec, fast, thought + call)
    assert not _accepts(compiler, spec, as_text, ["<|channel|>commentary to=functions.get_weather <|constrain|>json"
                                                  '<|message|>{"city": "Paris"}<|call|>'])  # markers as text
    assert not _accepts(compiler, spec, fast, call[:5] + ['{"town": "Paris"}', "<|call|>"])
    assert not _accepts(compiler, spec, fast, call[:-1])  # a call must end with <|call|>
    time_call = ["<|channel|>", "commentary to=functions.get_time ", "<|constrain|>", "json", "<|message|>", "{}",
                 "<|call|>"]
    assert _accepts(compiler, spec, fast, time_call) == (choice == "required")
    assert call_grammar(ToolPlan(WEATHER, "auto", None, True, "hermes"), set(MARKERS)) is None
