"""gpt-oss replies in OpenAI's harmony format, read into reasoning, content and tool calls as their text
arrives (the reader brisk.server.responses gives gpt-oss models by default), and forced calls written in it
(`call_grammar`).

A harmony reply is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the generation prompt ends with `<|start|>assistant`, so the first header has no `<|start|>`). The header
names the channel and, for a tool call, the recipient (`to=functions.NAME`, before or after the channel);
the body runs to `<|end|>`, `<|call|>` or `<|return|>` (the last two end the reply: they are gpt-oss's stop
tokens, and may be missing from the text when the server stops on them). Routing, as vLLM's and
llama.cpp's gpt-oss parsers do:

- `analysis` -> `reasoning_content`; so is a message to a recipient that is not a function (the model's own
  built-in browser or python tools: not something a client's function can answer);
- `final` -> `content`; `commentary` without a recipient (a preamble the user may see) -> `content`;
- a message to `functions.NAME` (in `commentary`, or any channel) -> a tool call NAME whose arguments are
  its body, streamed as it arrives (id and name as soon as the header ends, then argument fragments).

Text that cannot be a harmony header (a model that ignored the format) is content. A reply cut by
max_tokens keeps what it has: inside reasoning or content, the text so far; inside a call, a partial call
(`cut` set); inside a header, nothing (no body began). Feeding the whole reply at once and feeding it in
pieces give the same result: everything goes through the same per-piece steps.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from brisk.structured.spec import GrammarSpec
from brisk.structured.tools import ToolCall, ToolDelta, ToolPlan, json_for_lark, strict_parameters
from brisk.text import held_back_length

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
BODY_ENDS = (END, CALL, RETURN)
# what a header may start with (after `<|start|>`): the role, a recipient, the channel, a constraint
HEADER_STARTS = (START, "assistant", "to=", CHANNEL, CONSTRAIN)
_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


def call_grammar(plan: ToolPlan, special: set[str]) -> GrammarSpec | None:
    """tool_choice `required` or a named function, forced in harmony's own syntax: an optional analysis message,
    then one call, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>`
    (a harmony reply holds one call: `<|call|>` ends it). `special`: the markers the tokenizer has as special
    tokens (a Lark grammar names those bare, so that only the token itself matches); the others are text. None
    for `auto` and `none`, which leave the model free."""
    if plan.choice in ("auto", "none"):
        return None

    def mark(marker: str) -> str:
        return marker if marker in special else json.dumps(marker)

    # a thought runs to <|end|>: any text where the markers are tokens, text without "<" where they are text
    thought = "/(.|\\n)*/" if END in special else "/[^<]*/"
    calls = []
    for i, tool in enumerate(t for t in plan.tools if plan.choice == "required" or t["function"]["name"] == plan.function):
        fn = tool["function"]
        params = strict_parameters(fn.get("parameters") or {"type": "object", "properties": {}})
        header = json.dumps(f"commentary to={FUNCTIONS}{fn['name']} ")
        calls.append(f'call{i}: {mark(CHANNEL)} {header} '
                     f'{mark(CONSTRAIN)} "json" {mark(MESSAGE)} %json {json_for_lark(params)} {mark(CALL)}')
    lark = "\n".join([
        "start: analysis? (" + " | ".join(f"call{i}" for i in range(len(calls))) + ")",
        f'analysis: {mark(CHANNEL)} "analysis" {mark(MESSAGE)} {thought} {mark(END)} {mark(START)} "assistant"',
        *calls]) + "\n"
    return GrammarSpec("lark", lark, "tool_choice")


@dataclass
class HarmonyStep:
    """What one feed (or the finish) releases."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolDelta] = field(default_factory=list)


class HarmonyParser:
    """Per choice: `feed` the reply's text as it arrives, `finish` at its end; after that `reasoning`,
    `content` and `calls` are the whole reply's."""

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self.cut = False  # the reply ended inside a tool call's arguments (max_tokens)
        self._state = "header"  # "header" -> "body" -> "between" -> "header" ...; or "plain"
        self._buffer = ""
        self._sink = "content"  # the body's destination: "reasoning", "content" or "call"
        self._call: ToolCall | None = None

    def feed(self, text: str) -> HarmonyStep:
        step = HarmonyStep()
        self._buffer += text
        while self._buffer and self._advance(step):
            pass
        return step

    def finish(self) -> HarmonyStep:
        step = HarmonyStep()
        held, self._buffer = self._buffer, ""
        if self._state == "body":
            self._emit(held, step)
            if self._call is not None:  # cut inside a call's arguments: a partial call, never content
                self.cut = True
                self._close_call()
        elif self._state == "plain":
            self._emit_to("content", held, step)
        elif self._state == "header" and held.strip() and not self._could_be_header(held):
            self._emit_to("content", held, step)
        # a cut header (or what follows a message's end) has no body: nothing of it is reply text
        self._state = "between"
        return step

    # -- the steps -------------------------------------------------------------------------------
    def _advance(self, step: HarmonyStep) -> bool:
        """Consume what the buffer allows; False when it must wait for more text."""
        if self._state == "plain":
            self._emit_to("content", self._buffer, step)
            self._buffer = ""
            return False
        if self._state == "between":
            stripped = self._buffer.lstrip()
            if stripped.startswith(START):
                self._buffer = stripped[len(START):]
                self._state = "header"
                return True
            if START.startswith(stripped):
                return False
            self._state = "header"  # a header without its <|start|>
            return True
        if self._state == "header":
            at = self._buffer.find(MESSAGE)
            if at == -1:
                if not self._could_be_header(self._buffer):
                    self._state = "plain"
                    return True
                return False
            self._open(self._buffer[:at], step)
            self._buffer = self._buffer[at + len(MESSAGE):]
            self._state = "body"
            return True
        ends = [(self._buffer.find(marker), marker) for marker in BODY_ENDS]
        found = [(at, marker) for at, marker in ends if at != -1]
        if not found:
            keep = held_back_length(self._buffer, BODY_ENDS)
            self._emit(self._buffer[:len(self._buffer) - keep], step)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        at, marker = min(found)
        self._emit(self._buffer[:at], step)
        self._buffer = self._buffer[at + len(marker):]
        if self._call is not None:
            self._close_call()
        self._state = "between"
        return True

    @staticmethod
    def _could_be_header(text: str) -> bool:
        head = text.lstrip()
        return any(head.startswith(s) or s.startswith(head) for s in HEADER_STARTS)

    def _open(self, header: str, step: HarmonyStep) -> None:
        """A message's header is complete: choose where its body goes."""
        channel = _CHANNEL_RE.search(header)
        recipient = _RECIPIENT_RE.search(header)
        name = recipient.group(1) if recipient else None
        if name and name.startswith(FUNCTIONS) and len(name) > len(FUNCTIONS):
            self._call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name[len(FUNCTIONS):])
            step.tool_calls.append(ToolDelta(len(self.calls), self._call.id, self._call.name, ""))
            self._sink = "call"
        elif name or (channel and channel.group(1) == "analysis"):
            self._sink = "reasoning"
        else:  # final, commentary without a recipient, or no channel named
            self._sink = "content"

    def _emit(self, text: str, step: HarmonyStep) -> None:
        self._emit_to(self._sink, text, step)

    def _emit_to(self, sink: str, text: str, step: HarmonyStep) -> None:
        if not text:
            return
        if sink == "call" and self._call is not None:
            self._call.arguments += text
            step.tool_calls.append(ToolDelta(len(self.calls), arguments=text))
        elif sink == "reasoning":
            self.reasoning += text
            step.reasoning += text
        else:
            self.content += text
            step.content += text

    def _close_call(self) -> None:
        assert self._call is not None
        self._call.complete = not self.cut
        self.calls.append(self._call)
        self._call = None
        self._sink = "content"
