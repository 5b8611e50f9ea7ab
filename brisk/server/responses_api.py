"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), on the chat path: a request's
input items become chat messages (the model's own template renders them), its tools, tool_choice and
text.format become chat's tools and response_format (so forced calls and JSON schemas go through the same
grammar), and the reply is read as chat's is (reasoning parser, tool-call parser) into Responses output
items: `reasoning`, `message` (output_text) and `function_call`, streamed as the typed events the official
SDK parses (response.created, .in_progress, .output_item.added, .content_part.added, .output_text.delta,
.reasoning_text.delta, .function_call_arguments.delta, their .done events, response.completed with usage).

State: `store` (OpenAI's default true) keeps a response in a bounded in-memory store (`ResponseStore`: the
last STORE_SIZE = 256 responses, least recently used dropped first, lost on restart), so that
`previous_response_id` continues it and `GET /v1/responses/{id}` returns it; `store: false` keeps nothing. `conversation` is refused (a 400 naming it).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from brisk.engine.outputs import RequestOutput
from brisk.server.errors import APIError
from brisk.server.protocol import (ChatCompletionRequest, MaxTokens, NonEmptyText, NumLogprobs, Text,
                                   _Request, _shown_key)
from brisk.server.responses import Formatter, _ChoiceReply
from brisk.structured.tools import ToolDelta, ToolPlan, merged

STORE_SIZE = 256  # responses kept for previous_response_id and GET (bounded: least recently used go first)
INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")

# Responses fields brisk does not implement, with what to do instead
UNSUPPORTED = {
    "conversation": "server-side conversations are not kept; send the earlier turns in `input`, or continue a stored "
                    "response with previous_response_id",
    "background": "background responses are not supported; remove it (or send false)",
    "prompt": "stored prompt templates are not supported; send the text in `input` and `instructions`",
    "max_tool_calls": "max_tool_calls is not supported; remove it (parallel_tool_calls: false gives one call)",
    "context_management": "context management is not supported; remove it",
}


class _ResponsesItem(_Request):
    """An input item: the keys an SDK writes into the items it returns are accepted as sent back."""

    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ResponsesTextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None  # an echoed output_text's citations: never part of the prompt
    logprobs: list[Any] | None = None


class ResponsesMessageItem(_ResponsesItem):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[Text, list[ResponsesTextPart]]


class ResponsesFunctionCall(_ResponsesItem):
    type: Literal["function_call"]
    call_id: NonEmptyText
    name: NonEmptyText
    arguments: Text


class ResponsesFunctionCallOutput(_ResponsesItem):
    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Union[Text, list[ResponsesTextPart]]


class ResponsesReasoningText(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ResponsesReasoningItem(_ResponsesItem):
    type: Literal["reasoning"]
    summary: list[ResponsesReasoningText] = []
    content: list[ResponsesReasoningText] | None = None
    encrypted_content: None = None  # brisk sends its reasoning as content, never encrypted


ResponsesInputItem = Annotated[Union[ResponsesMessageItem, ResponsesFunctionCall, ResponsesFunctionCallOutput, ResponsesReasoningItem],
                      Field(union_mode="left_to_right")]


class ResponsesTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedFunction(_Request):
    type: Literal["function"]
    name: NonEmptyText


class ResponsesTextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    description: Text | None = None
    schema_: Union[dict[str, Any], None] = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(_Request):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Request):
    model: Text | None = None
    # a list holds at least one item besides reasoning (reasoning alone renders no message)
    input: Union[Text, Annotated[list[ResponsesInputItem], Field(min_length=1, json_schema_extra={"contains": {
        "not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}})]]
    instructions: Text | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponsesNamedFunction, None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_logprobs: NumLogprobs | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: NonEmptyText | None = None
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, Text] | None = None
    # cosmetic: accepted, never read (as on chat)
    user: Text | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # brisk's, as on chat
    cache_salt: NonEmptyText | None = None
    priority: int = 0

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        """A field brisk does not implement is a 400 naming it (those in UNSUPPORTED say what to do instead),
        unless it is sent as null or false (what an SDK writes for "not this")."""
        if not isinstance(data, dict):
            return data
        kept = {}
        for key, value in data.items():
            if key not in cls.model_fields:
                if key in UNSUPPORTED and value in (None, False):
                    continue
                reason = UNSUPPORTED.get(key) or ("is not a Responses field brisk implements, and ignoring it could "
                                                  "change the result; remove it (GET /openapi.json lists the fields)")
                raise ValueError(f"{_shown_key(key)}: {reason}")
            kept[key] = value
        return kept


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_id() -> str:
    return _new_id("resp")


# -- input items -> chat messages ----------------------------------------------------------------------------
def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages (roles, assistant tool calls, tool results, earlier reasoning)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # an earlier turn's reasoning, rendered with the assistant message that follows it
    for item in body.input:
        if isinstance(item, ResponsesMessageItem):
            message = {"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)}
            if item.role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            messages.append(message)
        elif isinstance(item, ResponsesFunctionCall):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or last.get("content") or "tool_calls" not in last:
                last = {"role": "assistant", "content": "", "tool_calls": []}
                if reasoning:
                    last["reasoning_content"], reasoning = "".join(reasoning), []
                messages.append(last)
            last["tool_calls"].append(call)
        elif isinstance(item, ResponsesFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            reasoning.append("".join(part.text for part in (item.content or item.summary)))
    return messages


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat completion the response is computed as, and the messages it carries (for the store)."""
    messages = history + input_messages(body)
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}] + messages
    if not messages:
        raise APIError(400, "input: holds reasoning items only; send at least one message or function call item",
                       param="input", code="invalid_value")
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                            "cache_salt": body.cache_salt, "priority": body.priority}
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(body, key) is not None:
            chat[key] = getattr(body, key)
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [_chat_tool(t) for t in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema: is required for type json_schema", param="text.format.schema",
                           code="invalid_value")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if (body.include and "message.output_text.logprobs" in body.include) or body.top_logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0
    try:
        return ChatCompletionRequest.model_validate(chat), messages
    except ValueError as e:  # a tool's or a message's contents refused by chat's own rules: name the field
        raise APIError(400, f"input: {_first_error(e)}", param="input", code="invalid_value") from None


def _first_error(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg')}"
    return str(e)


def _chat_tool(tool: ResponsesTool) -> dict[str, Any]:
    function = {"name": tool.name, **({"description": tool.description} if tool.description else {}),
                **({"parameters": tool.parameters} if tool.parameters is not None else {}),
                **({"strict": tool.strict} if tool.strict is not None else {})}
    return {"type": "function", "function": function}


# -- the store ------------------------------------------------------------------------------------------------
class ResponseStore:
    """The last `size` stored responses: their Response objects and the conversation (chat messages, the reply
    included) a previous_response_id continues. In memory, bounded, thread-safe; lost on restart."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def history(self, response_id: str) -> list[dict[str, Any]]:
        found = self.get(response_id)
        if found is None:
            raise APIError(404, f"previous_response_id: response {response_id!r} is not in brisk's store (it keeps the "
                                f"last {self.size} responses sent with store: true, in memory; a restart empties it); "
                                "send the earlier turns in `input` instead", param="previous_response_id",
                           code="response_not_found")
        return [dict(m) for m in found[1]]


# -- output: engine outputs -> Response items and events ---------------------------------------------------------
class ResponsesFormatter(Formatter):
    """One Response: its output items built as the reply arrives (reasoning, then the message and the calls),
    events numbered in order, the finished object stored when asked."""

    done_marker = False  # a Responses stream ends with response.completed, no [DONE]

    def __init__(self, response_id: str, state, body: ResponsesRequest, tools: ToolPlan | None,
                 reasoning_parser: str | None, conversation: list[dict[str, Any]]):
        super().__init__(response_id, state, want_logprobs=False)
        self.state, self.body, self.conversation = state, body, conversation
        self.reply = _ChoiceReply(tools, reasoning_parser)
        self.items: list[dict[str, Any]] = []  # output items, in order
        self.open: dict[str, int] = {}  # "reasoning" / "message" / "call:{i}" -> its index in items
        self.sequence = 0
        self.created_at = time.time()
        self.status, self.incomplete = "in_progress", None

    # -- the Response object ------------------------------------------------------------------------------------
    def response(self, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else \
            {"type": "text"}
        tool_choice = body.tool_choice
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
               "model": self.model, "output": [dict(i) for i in self.items], "error": None,
               "incomplete_details": self.incomplete, "instructions": body.instructions,
               "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
               "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
               "previous_response_id": body.previous_response_id, "store": body.store, "truncation": "disabled",
               "tool_choice": tool_choice.model_dump() if isinstance(tool_choice, BaseModel) else (tool_choice or "auto"),
               "tools": [t.model_dump() for t in (body.tools or [])],
               "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
               "text": {"format": fmt}, "user": body.user, "usage": usage}
        if self.status != "in_progress":
            out["completed_at"] = time.time()
        return out

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def encode(self, event: dict[str, Any]) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def error_events(self, error: APIError) -> list[str]:
        self.status = "failed"
        return [self.encode(self._event("error", code=error.code, message=error.message, param=error.param))]

    # -- items as the reply arrives ------------------------------------------------------------------------------
    def _open_item(self, key: str, item: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
        self.open[key] = len(self.items)
        self.items.append(item)
        events.append(self._event("response.output_item.added", output_index=self.open[key], item=dict(item)))
        return item

    def _reasoning(self, text: str, events: list[dict[str, Any]]) -> None:
        if "reasoning" not in self.open:
            item = self._open_item("reasoning", {"id": _new_id("rs"), "type": "reasoning", "summary": [],
                                                 "content": [], "status": "in_progress"}, events)
            item["content"] = [{"type": "reasoning_text", "text": ""}]
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.open["reasoning"],
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        index = self.open["reasoning"]
        item = self.items[index]
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta=text))

    def _content(self, text: str, events: list[dict[str, Any]]) -> None:
        for call in [k for k in self.open if k.startswith("call:")]:  # text after calls: they are finished
            self._close(call, events, "completed")
        if "message" not in self.open:
            item = self._open_item("message", {"id": _new_id("msg"), "type": "message", "role": "assistant",
                                               "status": "in_progress", "content": []}, events)
            item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.open["message"],
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                             "logprobs": []}))
        index = self.open["message"]
        item = self.items[index]
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta=text, logprobs=[]))

    def _call(self, delta: ToolDelta, events: list[dict[str, Any]]) -> None:
        key = f"call:{delta.index}"
        if key not in self.open:  # a new call: the text and the calls before it are finished
            for earlier in [k for k in self.open if k == "message" or k.startswith("call:")]:
                self._close(earlier, events, "completed")
            self._open_item(key, {"id": _new_id("fc"), "type": "function_call", "call_id": delta.id or _new_id("call"),
                                  "name": delta.name or "", "arguments": "", "status": "in_progress"}, events)
        index = self.open[key]
        item = self.items[index]
        if delta.arguments:
            item["arguments"] += delta.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                      delta=delta.arguments))

    def _close(self, key: str, events: list[dict[str, Any]], status: str) -> None:
        index = self.open.pop(key)
        item = self.items[index]
        item["status"] = status
        if item["type"] == "reasoning":
            part = item["content"][0]
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))))

    def _feed(self, out: RequestOutput) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        reasoning, content, calls = self.reply.feed(out.delta_text, out.finished)
        if reasoning:
            self._reasoning(reasoning, events)
        if (content or calls) and "reasoning" in self.open:  # the answer began: thinking is over
            self._close("reasoning", events, "completed")
        if content:
            self._content(content, events)
        for delta in merged(calls):
            self._call(delta, events)
        if out.finished:
            cut = out.finish_reason == "length"
            if cut:
                self.incomplete = {"reason": "max_output_tokens"}
            for key in list(self.open):
                self._close(key, events, "incomplete" if cut else "completed")
            self.status = "incomplete" if cut else "completed"
        return events

    # -- Formatter -------------------------------------------------------------------------------------------
    def observe(self, index: int, out: RequestOutput) -> None:
        self._feed(out)

    def first_chunks(self, jobs, guards) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def chunks(self, index: int, out: RequestOutput, body) -> list[dict[str, Any]]:
        return self._feed(out)

    def last_chunks(self, body, usage: dict[str, Any]) -> list[dict[str, Any]]:
        final = self.response(self._usage(usage))
        self._store(final)
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [self._event(kind, response=final)]

    def full_response(self, finals, jobs, guards, usage) -> dict[str, Any]:
        final = self.response(self._usage(usage))
        self._store(final)
        return final

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        reasoning = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        out = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
               "total_tokens": usage["total_tokens"],
               "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
               "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage["completion_tokens"])}}
        if "brisk" in usage:
            out["brisk"] = usage["brisk"]
        return out

    def _store(self, final: dict[str, Any]) -> None:
        if not self.body.store:
            return
        conversation = list(self.conversation)
        for item in self.items:
            if item["type"] == "message":
                conversation.append({"role": "assistant", "content": item["content"][0]["text"]})
            elif item["type"] == "function_call":
                last = conversation[-1] if conversation else None
                if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                    last = {"role": "assistant", "content": "", "tool_calls": []}
                    conversation.append(last)
                last["tool_calls"].append({"id": item["call_id"], "type": "function",
                                           "function": {"name": item["name"], "arguments": item["arguments"]}})
        self.state.responses.put(final, conversation)
