"""Request bodies: read, bounded, then parsed and validated — on the event loop when small, in a
worker thread when large, so that a body of millions of token ids or messages never stalls /health
or a running stream (an 11 MB list of ids once held the loop 4-10 s before it was refused).

Before any per-item validation, the sizes a request's cost grows with are checked from the parsed
JSON: token ids against --max-token-ids, messages against --max-messages; each is a 413 naming its
flag. Parsing follows FastAPI's own rules for a JSON body (the content type, empty and malformed
bodies), and validation errors become the same one-line 400s (brisk/server/errors.py).
"""

from __future__ import annotations

import email.message
import json
from typing import Any, TypeVar

import pydantic_core
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from brisk.server.errors import APIError

# Bodies up to this size are parsed on the event loop (microseconds); larger ones in a worker thread.
OFF_LOOP_BYTES = 64 * 1024

Model = TypeVar("Model", bound=BaseModel)


async def parse_body(state, raw: Request, model: type[Model]) -> Model:
    data = await raw.body()
    content_type = raw.headers.get("content-type")
    if len(data) <= OFF_LOOP_BYTES:
        return parse(state.config, data, content_type, model)
    return await state.run_tokenizer(parse, state.config, data, content_type, model)


def parse(config, data: bytes, content_type: str | None, model: type[Model]) -> Model:
    body = _decoded(data, content_type)
    if isinstance(body, dict):
        check_sizes(config, body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
    except RecursionError:
        raise _too_deep() from None


def _decoded(data: bytes, content_type: str | None) -> Any:
    """The body as FastAPI reads a JSON body parameter: None when empty, parsed JSON when the content
    type is absent or JSON, else the raw bytes (which then fail validation as "not an object")."""
    if not data:
        return None
    if content_type:
        message = email.message.Message()
        message["content-type"] = content_type
        subtype = message.get_content_subtype()
        if message.get_content_maintype() != "application" or not (subtype == "json" or subtype.endswith("+json")):
            return data
    try:
        # pydantic's JSON reader: 2-3x faster than json.loads on large bodies (a 17 MB list of token ids:
        # 0.10 s vs 0.23 s, both holding the GIL), and it refuses what is not valid Unicode (lone surrogates)
        return pydantic_core.from_json(data)
    except ValueError as e:
        if "recursion limit" in str(e):
            raise _too_deep() from None
        if "escape" in str(e):  # a lone surrogate: Python's reader takes it, so validation can name its field
            return _python_json(data)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": str(e)}}]) from None


def _python_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": str(e)}}]) from None


def _too_deep() -> APIError:
    return APIError(400, "the request body nests JSON too deeply to read; flatten it", code="invalid_json")


def check_sizes(config, body: dict[str, Any]) -> None:
    """413 for token ids and messages past the server's limits, counted before any item is validated."""
    for param in ("prompt", "tokens"):
        ids = _count_token_ids(body.get(param))
        if ids > config.max_token_ids:
            raise APIError(413, f"{param}: {ids} token ids, over the server's limit of {config.max_token_ids} per "
                                f"request (--max-token-ids); send fewer", param=param, code="prompt_too_large")
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > config.max_messages:
        raise APIError(413, f"messages: {len(messages)} messages, over the server's limit of {config.max_messages} "
                            "per request (--max-messages); send fewer (summarise old turns)",
                       param="messages", code="prompt_too_large")


def _count_token_ids(value: Any) -> int:
    """Token ids in a prompt given as ids ([1, 2] or [[1, 2], [3]]); 0 for text."""
    if not isinstance(value, list) or not value:
        return 0
    if isinstance(value[0], list):
        return sum(len(p) for p in value if isinstance(p, list))
    return len(value) if not isinstance(value[0], str) else 0
