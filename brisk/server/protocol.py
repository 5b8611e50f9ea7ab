"""OpenAI request schemas (pydantic). Every range check names its field, so a bad value
becomes a 400 that says which one. A top-level field brisk does not implement is refused
with a 400 naming it (as OpenAI refuses unrecognized arguments), never silently ignored:
it could change the result. Only `COSMETIC` fields pass unread.

Validation is strict: no implicit coercion (`"stream": "yes"`, `"tokens": ["1"]` and
`[[false]]` as token 0 are errors, not guesses), and every string must be valid Unicode
(a lone UTF-16 surrogate such as `"\\ud800"` is rejected with the field's name).

The JSON schema says what the server accepts: where a rule spans fields (exactly one of
`prompt`/`messages`; `content` required unless the role is `assistant`) it is written
into the schema too, and the limits only known once the model is loaded (vocabulary
size, context window, capacity) are marked here and filled in by `brisk.server.openapi`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from brisk.engine.sampling_params import MAX_LOGPROBS

ROLES = ("system", "developer", "user", "assistant", "tool")

# Markers read by brisk.server.openapi, which replaces them with the loaded model's limits.
TOKEN_ID_MARK = "x-brisk-token-id"
TOKEN_ID_KEY_MARK = "x-brisk-token-id-key"
MAX_TOKENS_MARK = "x-brisk-max-tokens"
CHOICES_MARK = "x-brisk-choices"


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode: a lone UTF-16 surrogate (\\u{ord(value[e.start]):04x}) at "
                         f"character {e.start}; send UTF-8 text (pair surrogates, or remove it)") from None
    return value


def _integral(value: Any) -> Any:
    """JSON Schema counts 96.0 as an integer; so does the server (but not "96", true or 96.5)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(**constraints: Any) -> Any:
    """An integer field (constraints before the validator, so the JSON schema shows them)."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


Int = _int()
MAX_CHOICES = 16  # n: choices one request may ask for
Choices = _int(ge=1, le=MAX_CHOICES, json_schema_extra={CHOICES_MARK: True})
# Any integer: SamplingParams reduces it modulo 2**64, the range torch's generators take. (A
# bound in the schema would be a float to JSON Schema tools: near 2**63 they round a value just
# past it onto it and call it valid, while the server, comparing integers, would refuse it.)
Seed = _int()
TopK = _int(ge=0)
NumLogprobs = _int(ge=0, le=MAX_LOGPROBS)
Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = _int(ge=0, json_schema_extra={TOKEN_ID_MARK: True})
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
MaxTokens = _int(ge=1, json_schema_extra={MAX_TOKENS_MARK: True})
# a token id written as a JSON object key (logit_bias); the pattern is narrowed to the vocabulary
TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,8})$"


def _token_id_key(key: str) -> str:
    if not re.fullmatch(TOKEN_ID_KEY, key):
        raise ValueError(f"key {key[:40]!r} is not a token id; send token ids as strings, e.g. {{\"50256\": -100}}")
    return key


# the pattern is in the schema (narrowed to the vocabulary by brisk.server.openapi) and checked by
# the validator, whose message says what a key should be
TokenIdKey = Annotated[str, AfterValidator(_token_id_key),
                       Field(json_schema_extra={"pattern": TOKEN_ID_KEY, TOKEN_ID_KEY_MARK: True})]


REASONING_EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class _Request(BaseModel):
    # a key brisk does not read is a 400 naming it: ignored, it could change what the client expects
    model_config = ConfigDict(extra="forbid", strict=True)


# Fields that do not change what is generated: accepted (declared in _Sampling) and not read.
COSMETIC = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id",
            "guided_decoding_backend")
# Fields of OpenAI's or vLLM's API that brisk does not implement, with what to do instead.
UNSUPPORTED = {
    "audio": "audio output is not supported (brisk serves text-only models); remove it",
    "modalities": "only text output is supported; remove it",
    "prediction": "predicted outputs are not supported; remove it",
    "web_search_options": "web search is not supported; remove it",
    "functions": "the legacy functions API is not supported; send `tools` instead",
    "function_call": "the legacy functions API is not supported; send `tool_choice` instead",
    "suffix": "insertion (suffix) is not supported; remove it",
    "best_of": "best_of is not supported; use n and pick a choice yourself",
    "use_beam_search": "beam search is not supported; remove it",
    "min_tokens": "min_tokens is not supported; remove it or raise max_tokens",
    "logits_processors": "custom logits processors are not supported; remove it",
    "prompt_logprobs": "prompt logprobs are not supported; remove it",
    "chat_template": "a per-request chat template is not supported; start the server with --chat-template",
}


def _refuse_unknown(model: type[BaseModel], data: Any) -> Any:
    if isinstance(data, dict):
        for key in data:
            if key in model.model_fields:
                continue
            reason = UNSUPPORTED.get(key)
            if reason is None:
                reason = ("is not a field brisk implements, and ignoring it could change the result; remove it "
                          "(the fields brisk accepts: GET /openapi.json)")
            raise ValueError(f"{_shown_key(key)}: {reason}")
    return data


def _shown_key(key: Any) -> str:
    """A key as an error message may quote it: valid UTF-8 (a lone surrogate shown as its escape)."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class FunctionCall(_Request):
    name: NonEmptyText
    arguments: Text  # a JSON object, as text (OpenAI's shape)


class ToolCall(_Request):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: NonEmptyText


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: Text | None = None
    # `schema` would shadow BaseModel.schema: the attribute is schema_, the JSON key "schema"
    schema_: Union[dict[str, Any], Literal[True], None] = Field(None, alias="schema")
    strict: bool | None = None


def _set(key: str) -> dict[str, Any]:
    """JSON Schema: `key` is present and not null."""
    return {"required": [key], "properties": {key: {"not": {"type": "null"}}}}


class ResponseFormat(_Request):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "if": {"required": ["type"], "properties": {"type": {"const": "json_schema"}}},
        "then": _set("json_schema")})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


_SO_MEMBERS = [_set("json"), {"required": ["json_object"], "properties": {"json_object": {"const": True}}},
               _set("regex"), _set("choice"), _set("grammar")]


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` object: exactly one of its constraint fields (whitespace_pattern
    with json or json_object only)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "oneOf": _SO_MEMBERS,
        "if": _set("whitespace_pattern"), "then": {"anyOf": _SO_MEMBERS[:2]}})

    json_: Union[dict[str, Any], Literal[True], Text, None] = Field(None, alias="json")  # `json` shadows BaseModel.json
    json_object: bool | None = None
    regex: NonEmptyText | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    grammar: NonEmptyText | None = None
    whitespace_pattern: NonEmptyText | None = None


_CONTENT_RULE = {"anyOf": [{"properties": {"role": {"const": "assistant"}}},
                           {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]}


def _text_part_only(part: Any) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind is not None and kind != "text":
        raise ValueError(f"content parts of type {kind!r} are not supported: brisk serves text-only models; "
                         "send text parts only")
    return part


# Keys the OpenAI SDK writes into an assistant message it returns; a client sending that message back
# sends them too. Empty, they say nothing and pass; set, brisk cannot render them: a 400 saying so.
ECHOED_MESSAGE_KEYS = {
    "refusal": "an earlier refusal is not rendered by chat templates; send it as content",
    "annotations": None,  # citations of the content: metadata, never part of the prompt
    "audio": "audio is not supported (brisk serves text-only models); remove it",
    "function_call": "the legacy functions API is not supported; send tool_calls instead",
}


def _message_keys(data: Any) -> Any:
    """A message key brisk does not render is a 400 naming it, never dropped silently."""
    if not isinstance(data, dict):
        return data
    unknown = [k for k in data if k not in ChatMessage.model_fields]
    if not unknown:
        return data
    data = dict(data)
    for key in unknown:
        value = data.pop(key)
        if key in ECHOED_MESSAGE_KEYS and (value is None or (key == "annotations" and isinstance(value, list))):
            continue
        if key == "annotations":
            raise ValueError("annotations: must be a list (the SDK's citations of the content) or null")
        reason = ECHOED_MESSAGE_KEYS.get(key) or ("is not a message field brisk renders; remove it (a message takes "
                                                 f"{', '.join(ChatMessage.model_fields)})")
        raise ValueError(f"{_shown_key(key)}: {reason}")
    return data


def _message_schema(schema: dict[str, Any]) -> None:
    """The message's JSON schema: the content rule, no other keys but the SDK's empty echoes."""
    schema.update(_CONTENT_RULE)
    schema["additionalProperties"] = False
    schema["properties"].update({"refusal": {"type": "null"}, "annotations": {"type": ["array", "null"]},
                                 "audio": {"type": "null"}, "function_call": {"type": "null"}})


class ChatMessage(_Request):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_message_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[Annotated[TextPart, BeforeValidator(_text_part_only)]], None] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    reasoning_content: Text | None = None  # an assistant's earlier thinking (templates that render it)

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        return _message_keys(data)

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: is required for role {self.role!r} (only an assistant message may omit it)")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


# The request fields that constrain the output; a request takes at most one (brisk.structured.spec)
_CONSTRAINTS = [
    {"required": ["response_format"], "properties": {"response_format": {
        "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}},
    *(_set(key) for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")),
]
# chat: a tool_choice that forces calls is a constraint too
_FORCED_TOOLS = {"required": ["tool_choice"], "properties": {"tool_choice": {
    "anyOf": [{"const": "required"}, {"type": "object"}]}}}


def _at_most_one(options: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"not": {"allOf": [a, b]}} for i, a in enumerate(options) for b in options[i + 1:]]


_WHITESPACE_RULE = {"if": _set("guided_whitespace_pattern"), "then": _set("guided_json")}
_SAMPLING_RULES = [*_at_most_one(_CONSTRAINTS), _WHITESPACE_RULE]


class _Sampling(_Request):
    """Fields shared by chat and completions (OpenAI's names and ranges, plus vLLM's extras).
    Any other top-level field is refused (`_refuse_unknown`; the schema says additionalProperties: false).
    Rules across fields (one output constraint at most; a whitespace pattern with guided_json only)
    are in the schema too, so that it calls valid only what the server accepts."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"allOf": _SAMPLING_RULES})

    model: Text | None = None
    n: Choices = 1
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: Seed | None = None
    stop: Union[NonEmptyText, list[NonEmptyText], None] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # cosmetic (COSMETIC): accepted, never read
    user: Text | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    request_id: Text | None = None
    guided_decoding_backend: Text | None = None
    # vLLM-style extensions
    top_k: TopK = 0
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    priority: Int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM: mixed into every prefix-cache block hash of this request, so it shares cached KV only with
    # requests carrying the same salt (tenants cannot probe each other's prompts by timing)
    cache_salt: NonEmptyText | None = None
    # brisk: false opts this request out of speculative decoding (same output distribution, one
    # token per step)
    speculative: bool = True
    # OpenAI: token id (as a string) -> bias added to its logit
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* extras and structured_outputs
    response_format: ResponseFormat | None = None
    # a JSON schema, or its JSON text; `true` (anything) is a schema too, `false` (nothing) is refused
    guided_json: Union[dict[str, Any], Literal[True], Text, None] = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyText | None = None
    guided_whitespace_pattern: NonEmptyText | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        return _refuse_unknown(cls, data)


_CHAT_RULES = [
    *_at_most_one([*_CONSTRAINTS, _FORCED_TOOLS]),
    # a tool_choice other than "none" needs tools
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}},
     "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
]


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"allOf": [_WHITESPACE_RULE, *_CHAT_RULES]})

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    # vLLM: extra variables for the chat template, e.g. Qwen3's {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI: how hard a reasoning model thinks; given to the chat template (brisk.server.prepare.reasoning_kwargs)
    reasoning_effort: REASONING_EFFORTS | None = None


class CompletionRequest(_Sampling):
    prompt: Union[NonEmptyText, Annotated[list[NonEmptyText], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: MaxTokens | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False


_ONE_OF_PROMPT = {"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}


class TokenizeRequest(_Request):
    """Exactly one of `prompt` (raw text) or `messages` (rendered with the chat template)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_OF_PROMPT)

    model: Text | None = None
    # Absent means "not this one"; null is not accepted (the schema then says exactly one is given).
    prompt: Text = None  # type: ignore[assignment]
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None  # type: ignore[assignment]
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    # as in chat completions, so that the count is theirs: the template's variables and the tools it renders
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: REASONING_EFFORTS | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the server sends (OpenAI's shape)."""

    error: ErrorDetail


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template; content parts joined; developer -> system."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def _arguments(text: str) -> Any:
    """Templates render a call's arguments with `tojson`: give them the object, not its JSON text."""
    try:
        return json.loads(text)
    except ValueError:
        return text
