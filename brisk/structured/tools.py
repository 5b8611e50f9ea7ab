"""Tool calls: the plan a request asks for, the grammar that forces a call (`required` or a named
function), and the reply parsed into OpenAI `tool_calls`, whole or streamed.

Two reply formats, chosen from the chat template:
- "hermes": calls inside `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` tags (Hermes,
  Qwen 2.5/3, SmolLM3 and brisk/templates/chatml_tools.jinja); text around them is content.
- "json": the whole reply is one call object `{"name": ..., "arguments"|"parameters": {...}}` or a
  list of them (Llama 3.1+ JSON tool calling).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from brisk.errors import ParamError
from brisk.structured.spec import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_TEMPLATE_HINT = ("start `brisk serve` with --chat-template FILE, a template that renders the `tools` variable "
                       "(brisk ships brisk/templates/chatml_tools.jinja for ChatML models)")


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool objects, as the chat template receives them
    choice: str  # "auto" | "none" | "required" | "function"
    function: str | None  # the function a named choice forces
    parallel: bool
    style: str  # "hermes" | "json"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def parses(self) -> bool:
        """Replies are parsed for calls (not with tool_choice "none")."""
        return self.choice != "none"


def plan(body: Any, template_source: str | None, template_variables: set[str]) -> ToolPlan | None:
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
    style = "hermes" if template_source and OPEN in template_source else "json"
    return ToolPlan(tools, choice, function, body.parallel_tool_calls is not False, style)


def _call_schema(tool: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def grammar(plan: ToolPlan) -> GrammarSpec | None:
    """`required` and a named choice force calls; `auto` and `none` leave the model free."""
    if plan.choice in ("auto", "none"):
        return None
    tools = [t for t in plan.tools if plan.choice == "required" or t["function"]["name"] == plan.function]
    schemas = [_call_schema(t) for t in tools]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    many = plan.parallel and plan.choice == "required"
    if plan.style == "hermes":
        call_rule = f'call: "{OPEN}\\n" %json {json.dumps(call)} "\\n{CLOSE}"'
        start = 'start: call ("\\n" call)*' if many else "start: call"
    else:
        body = {"type": "array", "items": call, "minItems": 1} if many else call
        call_rule = ""
        start = f"start: %json {json.dumps(body)}"
    return GrammarSpec("lark", f"{start}\n{call_rule}\n", "tool_choice")


def _as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished reply. Text that is not a well-formed call of a known
    function stays content: nothing the model wrote is dropped. With parallel_tool_calls false,
    only the first call is a call."""
    if plan.style == "hermes":
        content, calls, rest = [], [], text
        while OPEN in rest and (plan.parallel or not calls):
            before, _, after = rest.partition(OPEN)
            inner, closed, rest = after.partition(CLOSE)
            try:
                call = _as_call(json.loads(inner), plan.names)
            except ValueError:
                call = None
            if call is None:
                content.append(before + OPEN + inner + (CLOSE if closed else ""))
            else:
                content.append(before)
                calls.append(call)
        content.append(rest)
        joined = "".join(content).strip() if calls else text
        return (joined or None), calls
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            obj = json.loads(stripped)
        except ValueError:
            return text, []
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_as_call(o, plan.names) for o in objs]
        if objs and all(c is not None for c in calls) and (plan.parallel or len(calls) == 1):
            return None, calls  # type: ignore[return-value]
    return text, []


@dataclass
class StreamingToolParser:
    """Per choice: content deltas go out as they come, until a call may be starting; from there the
    text is held and parsed when the choice finishes."""

    plan: ToolPlan
    text: str = ""  # everything generated so far
    sent: int = 0  # characters of `text` already sent as content
    holding: bool = False  # a call has started: hold the rest
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        """The content delta that is safe to send now."""
        self.text += delta
        if self.holding:
            return ""
        if self.plan.style == "hermes":
            start = self.text.find(OPEN, self.sent)
            if start != -1:
                self.holding = True
                return self._release(start)
            return self._release(len(self.text) - _partial_suffix(self.text, OPEN))
        if not self.text.strip():
            return ""  # leading whitespace: a call or text, not known yet
        if self.sent == 0 and self.text.lstrip()[:1] in ("{", "["):
            self.holding = True
            return ""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> str:
        """At the end: parse what was held; returns the content still to send."""
        content, self.calls = parse(self.text, self.plan)
        if not self.calls:
            return self._release(len(self.text))
        # what the whole reply's content has beyond the text sent before the first call (text between
        # or after the calls, a malformed call): streamed and whole replies carry the same content
        sent = self.text[:self.sent].lstrip()
        self.sent = len(self.text)
        return (content or "")[len(sent):] if sent else (content or "")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
