"""Tool calls: the plan a request asks for, the grammar that forces calls (`required` or a named
function), and the parser that turns a reply into content and OpenAI `tool_calls` as its text
arrives. A whole reply is parsed by feeding it at once, so a streamed reply and a whole one give
the same content and the same calls by construction.

Formats, chosen from the chat template (or `--tool-call-parser`):
- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3, SmolLM3,
  brisk/templates/chatml_tools.jinja); text around the calls is content.
- "json": the reply is a call object `{"name": ..., "parameters"|"arguments": {...}}`, a list of them,
  or objects separated by ";", after an optional `<|python_tag|>` (Llama 3.1+ JSON tool calling).
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral Nemo) or
  `[TOOL_CALLS]name[ARGS]{...}` (Mistral Small 3.2, Devstral).

Streaming, as OpenAI streams calls: a call's id and name go out as soon as its name is read (and
is one of the request's functions), then its `arguments` JSON text in fragments as the tokens
arrive. Until the name is known the call's text is held back; if it turns out not to be a call of
a known function, the held text is content (nothing the model wrote is dropped). Content that is
only whitespace before a call is not sent.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from typing import Any

from brisk.errors import ParamError
from brisk.structured.sources import JSON_OPTIONS
from brisk.structured.spec import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_OPEN, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
STYLES = ("hermes", "json", "mistral")
TOOLS_TEMPLATE_HINT = ("start `brisk serve` with --chat-template FILE, a template that renders the `tools` variable "
                       "(brisk ships brisk/templates/chatml_tools.jinja for ChatML models)")
_ARGUMENT_KEYS = ("arguments", "parameters")


def renders_tool_calls(template_source: str | None) -> bool:
    """Whether a chat template reads messages' `tool_calls` (one that does not drops them)."""
    return bool(template_source) and "tool_calls" in template_source


def style_of_template(template_source: str | None) -> str:
    """The reply format a chat template teaches its model."""
    source = template_source or ""
    if OPEN in source:
        return "hermes"
    if MISTRAL_OPEN in source:
        return "mistral"
    return "json"


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool objects, as the chat template receives them
    choice: str  # "auto" | "none" | "required" | "function"
    function: str | None  # the function a named choice forces
    parallel: bool
    style: str  # one of STYLES

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def parses(self) -> bool:
        """Replies are parsed for calls (not with tool_choice "none")."""
        return self.choice != "none"


def plan(body: Any, template_source: str | None, template_variables: set[str], style: str | None = None
         ) -> ToolPlan | None:
    """The request's tools and tool_choice, checked against the chat template; None without tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise ParamError("tool_choice", "needs `tools`: give the functions the model may call")
        return None
    if "tools" not in template_variables:
        raise ParamError("tools", "this model's chat template does not render tools, so the model would never see "
                                  f"them; {TOOLS_TEMPLATE_HINT}")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ParamError("tools", "function names must be unique")
    function = None
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        function = choice.function.name
        if function not in names:
            raise ParamError("tool_choice", f"function {function!r} is not among the tools ({', '.join(names)})")
        choice = "function"
    return ToolPlan(tools, choice, function, body.parallel_tool_calls is not False,
                    style or style_of_template(template_source))


# -- forcing calls ------------------------------------------------------------------------
def strict_parameters(schema: Any) -> Any:
    """A function's parameters as OpenAI's strict mode reads them for a forced call: an object
    schema that does not say otherwise allows no properties beyond those it declares (a small model
    told "any other property" invents them forever). Required ones stay as declared."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        is_object = node.get("type") == "object" or (isinstance(node.get("type"), list) and "object" in node["type"])
        if (is_object or "properties" in node) and "additionalProperties" not in node \
                and "patternProperties" not in node and "unevaluatedProperties" not in node:
            node["additionalProperties"] = False
        stack.extend(v for k, v in node.items() if k not in ("const", "enum", "default", "examples"))
    return schema


def _relocated(schema: Any, prefix: str) -> Any:
    """`schema` with its local `$ref`s ("#/$defs/X") pointing into it where it is embedded at JSON
    pointer `prefix` of a larger schema (pydantic's parameters use $defs/$ref)."""
    if isinstance(schema, list):
        return [_relocated(s, prefix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = prefix + value[1:]
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value
        else:
            out[key] = _relocated(value, prefix)
    return out


def _call_schema(tool: dict[str, Any], args_key: str, pointer: str) -> dict[str, Any]:
    """The schema of one call object, found at JSON pointer `pointer` of the grammar's schema."""
    fn = tool["function"]
    params = strict_parameters(fn.get("parameters") or {"type": "object", "properties": {}})
    params = _relocated(params, f"{pointer}/properties/{args_key}")
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def _calls_schema(tools: list[dict[str, Any]], args_key: str, pointer: str) -> dict[str, Any]:
    if len(tools) == 1:
        return _call_schema(tools[0], args_key, pointer)
    return {"anyOf": [_call_schema(t, args_key, f"{pointer}/anyOf/{i}") for i, t in enumerate(tools)]}


def grammar(plan: ToolPlan) -> GrammarSpec | None:
    """`required` and a named choice force calls; `auto` and `none` leave the model free. With
    parallel calls the list may end after any call; without, it is exactly one call."""
    if plan.choice in ("auto", "none"):
        return None
    tools = [t for t in plan.tools if plan.choice == "required" or t["function"]["name"] == plan.function]
    many = plan.parallel and plan.choice == "required"
    if plan.style == "hermes":
        call_rule = f'call: "{OPEN}\\n" %json {json_for_lark(_calls_schema(tools, "arguments", "#"))} "\\n{CLOSE}"'
        return GrammarSpec("lark", f'{"start: call (chr10 call)*" if many else "start: call"}\n'
                                   f'{call_rule}\nchr10: "\\n"\n', "tool_choice")
    args_key = "parameters" if plan.style == "json" else "arguments"
    if many or plan.style == "mistral":
        calls = {"type": "array", "items": _calls_schema(tools, args_key, "#/items"), "minItems": 1}
        if not many:
            calls["maxItems"] = 1
    else:
        calls = _calls_schema(tools, args_key, "#")
    prefix = f'"{MISTRAL_OPEN}" ' if plan.style == "mistral" else ""
    return GrammarSpec("lark", f"start: {prefix}%json {json_for_lark(calls)}\n", "tool_choice")


def json_for_lark(schema: dict[str, Any]) -> str:
    """A schema for Lark's %json, with the JSON layout of response_format's: no free whitespace (a
    small model given it pads forever), ", " and ": " as separators."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})



# -- reading calls ------------------------------------------------------------------------
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the JSON text of the arguments, as the model wrote it
    complete: bool = False

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    """A streamed piece of one call: its start (id and name) or a fragment of its arguments."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


def merged(deltas: list[ToolDelta]) -> list[ToolDelta]:
    """The deltas of one step as OpenAI streams them: at most one per call index, in the order the calls
    first appear, a call's start (id and name) kept with its argument fragments joined. A client that
    reads `delta.tool_calls[0]` of each chunk then sees every fragment."""
    by_index: dict[int, ToolDelta] = {}
    for d in deltas:
        held = by_index.get(d.index)
        if held is None:
            by_index[d.index] = ToolDelta(d.index, d.id, d.name, d.arguments)
        else:
            held.id, held.name = held.id or d.id, held.name or d.name
            held.arguments += d.arguments
    return list(by_index.values())


_WS = " \t\r\n"


class _ObjectScanner:
    """Reads one JSON object character by character: the call's `name` when its string ends, and the
    text of its arguments value (`arguments` or `parameters`) as it goes; `whole_is_arguments`: the
    object is the arguments itself (Mistral's [ARGS]). Only the structure is checked, enough to find
    where values start and end; the arguments' text is passed on as the model wrote it."""

    def __init__(self, whole_is_arguments: bool = False):
        self.whole_is_arguments = whole_is_arguments
        self.depth = 0
        self.in_string = self.escape = False
        self.name: str | None = None
        self.error = self.done = False
        self._expect = "{"  # then "key", ":", "value", "in_value" (a value at depth 1), ","
        self._key: str | None = None
        self._token = ""  # a key or a depth-1 string/primitive value, as written
        self._capturing = False  # inside the arguments value
        self._scalar_args: str | None = None  # arguments written as a string or a primitive: sent when whole
        self._fragment = ""

    def take_args(self) -> str:
        """The arguments text read since the last call."""
        out, self._fragment = self._fragment, ""
        return out

    def feed(self, ch: str) -> None:
        if self.done or self.error:
            return
        if self.whole_is_arguments and (self.depth or ch == "{"):
            self._fragment += ch
        if self.in_string:
            self._string_char(ch)
        elif self.depth == 0:
            self._before(ch)
        elif self.depth > 1:
            self._nested(ch)
        else:
            self._top(ch)

    def _capture(self, ch: str) -> None:
        if self._capturing:
            if self._scalar_args is None:
                self._fragment += ch
            else:
                self._scalar_args += ch

    def _before(self, ch: str) -> None:
        if ch == "{":
            self.depth, self._expect = 1, "key"
        elif ch not in _WS:
            self.error = True

    def _string_char(self, ch: str) -> None:
        self._capture(ch)
        if self.depth == 1:
            self._token += ch
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            if self.depth == 1:
                self._top_string_ended()

    def _top_string_ended(self) -> None:
        try:
            value = json.loads(self._token)
        except ValueError:
            self.error = True
            return
        if self._expect == "key":
            self._key, self._expect = value, ":"
        else:  # a string value
            if self._key == "name" and self.name is None:
                self.name = value if isinstance(value, str) else None
            self._value_ended()

    def _nested(self, ch: str) -> None:
        self._capture(ch)
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._value_ended()

    def _top(self, ch: str) -> None:
        expect = self._expect
        if expect == "in_value":  # a number, true, false or null
            if ch not in ",}" and ch not in _WS:
                self._capture(ch)
                return
            self._value_ended()
            expect = self._expect
        if ch in _WS:
            return
        if expect == "key" and ch == '"':
            self.in_string, self._token = True, ch
        elif expect == "key" and ch == "}" and self._key is None:
            self._closed()
        elif expect == ":" and ch == ":":
            self._expect = "value"
        elif expect == "value":
            self._value_started(ch)
        elif expect == "," and ch == ",":
            self._expect = "key"
        elif expect == "," and ch == "}":
            self._closed()
        else:
            self.error = True

    def _value_started(self, ch: str) -> None:
        self._expect, self._token = "in_value", ""
        self._capturing = self._key in _ARGUMENT_KEYS and not self.whole_is_arguments
        self._scalar_args = None if ch in "{[" or not self._capturing else ""
        self._capture(ch)
        if ch in "{[":
            self.depth += 1
        elif ch == '"':
            self.in_string, self._token = True, ch

    def _value_ended(self) -> None:
        if self._capturing and self._scalar_args is not None:  # arguments as a JSON string: its text
            try:
                value = json.loads(self._scalar_args)
            except ValueError:
                value = self._scalar_args
            self._fragment += value if isinstance(value, str) else json.dumps(value)
        self._expect, self._token, self._capturing, self._scalar_args = ",", "", False, None

    def _closed(self) -> None:
        self.depth, self.done = 0, True


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Per choice: feed the reply's text as it arrives; each feed returns the content to send and the
    call deltas, and `finish` what remains at the end. After it, `content` and `calls` are the whole
    reply's."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.content = ""  # all content sent
        self.calls: list[ToolCall] = []
        self.cut = False  # the reply ended inside a call (max_tokens)
        self.repeated = False  # a call repeated the one before it exactly and was left out
        self._state = "start" if plan.style == "json" else "text"
        self._tail = ""  # text mode: trailing whitespace and a possible opener's first characters
        self._held = ""  # a possible call's text: content again if it is not a call of a known function
        self._scanner: _ObjectScanner | None = None
        self._call: ToolCall | None = None  # the call being read, once its name is known
        self._held_deltas: list[ToolDelta] = []  # deltas of a call that may repeat the one before
        self._container = ""  # "array": calls in a JSON list; "semicolon": Llama's ";"-separated calls
        self._name = ""  # Mistral's [TOOL_CALLS]name[ARGS]: the name so far

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        content: list[str] = []
        deltas: list[ToolDelta] = []
        for ch in text:
            self._step(ch, content, deltas)
        return self._sent(content), deltas

    def finish(self) -> tuple[str, list[ToolDelta]]:
        content: list[str] = []
        deltas: list[ToolDelta] = []
        if self._call is not None:  # cut by max_tokens inside a known call: a (partial) call, never content
            self.cut = True
            self._emit_args(deltas)
            deltas.extend(self._held_deltas)
            self._held_deltas = []
            self.calls.append(self._call)
            self._call = None
        elif self._held:
            content.append(self._held)
        if self._tail and (self._tail.strip() or not self.calls):
            content.append(self._tail)
        self._held = self._tail = ""
        return self._sent(content), deltas

    def _sent(self, content: list[str]) -> str:
        text = "".join(content)
        self.content += text
        return text

    # -- the states ------------------------------------------------------------------------
    def _step(self, ch: str, content: list[str], deltas: list[ToolDelta]) -> None:
        getattr(self, f"_{self._state}")(ch, content, deltas)

    def _content(self, ch: str, content: list[str], deltas: list[ToolDelta]) -> None:
        """The rest of the reply is content."""
        content.append(self._tail + ch)
        self._tail = ""

    def _start(self, ch: str, content: list[str], deltas: list[ToolDelta]) -> None:
        """JSON style: the reply is calls if it starts with one (after whitespace and <|python_tag|>)."""
        self._held += ch
        body = self._held.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(body):
            return
        if not body:
            return
        if body[0] in "{[":
            self._container = "array" if body[0] == "[" else "semicolon"
            self._state = "opening"
            if body[0] == "{":
                self._opening(ch, content, deltas, added=True)
        else:
            self._abandon(content, "content")

    def _text(self, ch: str, content: list[str], deltas: list[ToolDelta]) -> None:
        opener = OPEN if self.plan.style == "hermes" else MISTRAL_OPEN
        self._tail += ch
        at = self._tail.find(opener)
        if at != -1:
            before = self._tail[:at]
            if before.strip():
                content.append(before.rstrip())
            self._held = before[len(before.rstrip()):] + opener  # content again if no known call follows
            self._tail = ""
            self._state = "opening"
            return
        keep = _partial_suffix(self._tail, opener)
        candidate = self._tail[:len(self._tail) - keep]
        if candidate.strip():  # send it, but hold its trailing whitespace: a call may follow
            sendable = candidate.rstrip()
            content.append(sendable)
            self._tail = self._tail[len(sendable):]

    def _opening(self, ch: str, content: list[str], deltas: list[ToolDelta], added: bool = False) -> None:
        """Between an opener (or a list's "[" or ",") and the call's object."""
        if not added:
            self._held += ch
        if ch in _WS:
            return
        if self.plan.style == "mistral" and self._container == "":
            if ch == "[":
                self._container = "array"
                return
            self._state, self._name = "mistral_name", ""
            self._mistral_name(ch, content, deltas, added=True)
        elif ch == "{":
            self._scanner = _ObjectScanner()
            self._state = "reading"
            self._scanner.feed(ch)
        else:
            self._abandon(content)

    def _reading(self, ch: str, content: list[str], deltas: list[ToolDelta]) -> None:
        scanner = self._scanner
        self._held += ch
        scanner.feed(ch)
        if self._call is None:
            if scanner.error or scanner.done and scanner.name is None:
                self._abandon(content)
                return
            if scanner.name is None:
                return
            if scanner.name not in self.plan.names or (self.calls and not self.plan.parallel):
                self._abandon(content)
                return
            self._call = ToolCall(_new_id(), scanner.name)
            self._emit(ToolDelta(len(self.calls), self._call.id, self._call.name), deltas)
        self._emit_args(deltas)
        if scanner.done or scanner.error:  # broken JSON in a known call: the text so far is its arguments
            self._finish_call(deltas)

    def _mistral_name(self, ch: str, content: list[str], deltas: list[ToolDelta], added: bool = False) -> None:
        if not added:
            self._held += ch
        self._name += ch
        if MISTRAL_ARGS not in self._name:
            if len(self._name) > 200 or "\n" in self._name:
                self._abandon(content)
            return
        name = self._name[:self._name.index(MISTRAL_ARGS)].strip()
        if name not in self.plan.names or (self.calls and not self.plan.parallel):
            self._abandon(content)
            return
        self._call = ToolCall(_new_id(), name)
        self._emit(ToolDelta(len(self.calls), self._call.id, name), deltas)
        self._scanner = _ObjectScanner(whole_is_arguments=True)
        self._state = "reading"

    def _after_call(self, ch: str, content: list[str], deltas: list[ToolDelta]) -> None:
        """After a call's object: Hermes's closing tag, a list's "," or "]", Llama's ";", or text."""
        self._held += ch
        if ch in _WS:
            return
        next_text = "text" if self.plan.parallel else "content"
        if self.plan.style == "hermes":
            tag = self._held.strip()
            if CLOSE.startswith(tag):
                if tag == CLOSE:
                    self._held, self._state = "", next_text
                return
        elif self._container == "array" and ch == "]":
            self._held, self._state = "", "content" if self.plan.style == "json" else next_text
            return
        elif (self._container == "array" and ch == ",") or (self._container == "semicolon" and ch == ";"):
            if self.plan.parallel:
                self._held, self._state = "", "opening"
            else:  # one call only: the rest of the list is content, as written
                self._abandon(content, "content")
            return
        rest, self._held = self._held.lstrip(), ""  # anything else: text (content for JSON style)
        self._state = "content" if self.plan.style == "json" else next_text
        for c in rest:
            self._step(c, content, deltas)

    # -- helpers ----------------------------------------------------------------------------
    def _abandon(self, content: list[str], state: str | None = None) -> None:
        """What was held was not a call of a known function: it is content; read on as text."""
        content.append(self._held)
        self._held, self._scanner, self._container, self._name = "", None, "", ""
        self._state = state or ("content" if self.plan.style == "json" else "text")

    def _emit(self, delta: ToolDelta, deltas: list[ToolDelta]) -> None:
        """Send a delta, unless this call may still be repeating the one before it (then hold it)."""
        self._held_deltas.append(delta)
        if not self._may_repeat():
            deltas.extend(self._held_deltas)
            self._held_deltas = []

    def _may_repeat(self) -> bool:
        if not self.calls or self._call is None:
            return False
        previous = self.calls[-1]
        return previous.name == self._call.name and previous.arguments.startswith(self._call.arguments)

    def _emit_args(self, deltas: list[ToolDelta]) -> None:
        fragment = self._scanner.take_args()
        if fragment:
            self._call.arguments += fragment
            self._emit(ToolDelta(len(self.calls), arguments=fragment), deltas)

    def _finish_call(self, deltas: list[ToolDelta]) -> None:
        call, self._call = self._call, None
        call.complete = True
        previous = self.calls[-1] if self.calls else None
        if previous is not None and (previous.name, previous.arguments) == (call.name, call.arguments):
            self.repeated, self._held_deltas = True, []  # an immediate exact repeat: left out
        else:
            deltas.extend(self._held_deltas)
            self._held_deltas = []
            self.calls.append(call)
        self._scanner, self._held, self._state = None, "", "after_call"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole reply: the streaming parser fed all of it at once."""
    parser = ToolCallParser(plan)
    parser.feed(text)
    parser.finish()
    content = parser.content if parser.content.strip() or not parser.calls else ""
    return content or None, [c.as_openai() for c in parser.calls]
