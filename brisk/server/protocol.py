"""OpenAI request schemas (pydantic). Unknown fields are ignored, as OpenAI does; every
range check names its field, so a bad value becomes a 400 that says which one."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from brisk.engine.sampling_params import MAX_LOGPROBS

ROLES = ("system", "developer", "user", "assistant", "tool")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by chat and completions (OpenAI's names and ranges, plus vLLM's extras)."""

    model: StrictStr | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Union[StrictStr, list[StrictStr], None] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # vLLM-style extensions
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TokenizeRequest(_Request):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template; content parts joined; roles checked."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ProtocolError(f"messages[{i}].role",
                                f"unknown role {m.role!r}; use one of {', '.join(ROLES)}")
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if content is None and m.role != "assistant":
            raise ProtocolError(f"messages[{i}].content", "is required for this role")
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


class ProtocolError(ValueError):
    """A request that parses but makes no sense; names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
