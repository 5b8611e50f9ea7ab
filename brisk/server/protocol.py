"""OpenAI request schemas (pydantic). Unknown fields are ignored, as OpenAI does; every
range check names its field, so a bad value becomes a 400 that says which one.

Validation is strict: no implicit coercion (`"stream": "yes"`, `"tokens": ["1"]` and
`[[false]]` as token 0 are errors, not guesses), and every string must be valid Unicode
(a lone UTF-16 surrogate such as `"\\ud800"` is rejected with the field's name).

The JSON schema says what the server accepts: where a rule spans fields (exactly one of
`prompt`/`messages`; `content` required unless the role is `assistant`) it is written
into the schema too, and the limits only known once the model is loaded (vocabulary
size, context window, capacity) are marked here and filled in by `brisk.server.openapi`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from brisk.engine.sampling_params import MAX_LOGPROBS

ROLES = ("system", "developer", "user", "assistant", "tool")

# Markers read by brisk.server.openapi, which replaces them with the loaded model's limits.
TOKEN_ID_MARK = "x-brisk-token-id"
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
Choices = _int(ge=1, le=16, json_schema_extra={CHOICES_MARK: True})
Seed = _int(ge=-(2**63), lt=2**64)
TopK = _int(ge=0)
NumLogprobs = _int(ge=0, le=MAX_LOGPROBS)
Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = _int(ge=0, json_schema_extra={TOKEN_ID_MARK: True})
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
MaxTokens = _int(ge=1, json_schema_extra={MAX_TOKENS_MARK: True})


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Request):
    type: Literal["text"]
    text: Text


_CONTENT_RULE = {"anyOf": [{"properties": {"role": {"const": "assistant"}}},
                           {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]}


class ChatMessage(_Request):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_CONTENT_RULE)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: Text | None = None

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: is required for role {self.role!r} (only an assistant message may omit it)")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by chat and completions (OpenAI's names and ranges, plus vLLM's extras)."""

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
    user: Text | None = None
    # vLLM-style extensions
    top_k: TopK = 0
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    priority: Int = 0


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None


class CompletionRequest(_Sampling):
    prompt: Union[NonEmptyText, Annotated[list[NonEmptyText], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: MaxTokens | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False


_ONE_OF_PROMPT = {"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}


class TokenizeRequest(_Request):
    """Exactly one of `prompt` (raw text) or `messages` (rendered with the chat template)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_ONE_OF_PROMPT)

    model: Text | None = None
    # Absent means "not this one"; null is not accepted (the schema then says exactly one is given).
    prompt: Text = None  # type: ignore[assignment]
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None  # type: ignore[assignment]
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

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
        out.append(msg)
    return out
