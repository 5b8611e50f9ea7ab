"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, one clear
message, never a stack trace. Every exception a route can raise ends here."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("brisk.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The same error as a final server-sent event for a stream already under way."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def printable(text: str) -> str:
    """Text that always encodes as UTF-8: an error message may quote the client's input, and a
    lone surrogate in it must not turn a 400 into a 500 while the response is written."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    message, param = printable(message), None if param is None else printable(param)
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500 else
                                                              "invalid_request_error"),
                      "param": param, "code": code}}


def _loc_to_param(loc: tuple) -> str | None:
    parts = [p for p in loc if p != "body"]
    if "[key]" in parts:  # a bad dict key: name the dict (the key is quoted in the message)
        parts = parts[:parts.index("[key]") - 1]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _is_union_tag(part) -> bool:
    """pydantic names the union member an error came from ('str', 'list[int]', 'TextPart',
    'function-after[_valid_unicode(), str]')."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part
                                      or part[:1].isupper() or part.startswith("constrained-"))


def _readable(tag: str) -> str:
    """'function-after[_valid_unicode(), constrained-str]' -> 'str'; 'list[constrained-int]' -> 'list[int]'."""
    return re.sub(r"function-after\[\w+\(\), ([^\]]+)\]", r"\1", tag).replace("constrained-", "")


def _tag_at(loc: tuple) -> int:
    return next((i for i, p in enumerate(loc) if _is_union_tag(p)), len(loc))


def _common_loc(errors: list[dict]) -> tuple:
    """The field all of a union's branch errors point at (the first error's field)."""
    first = tuple(errors[0].get("loc", ()))
    return first[:_tag_at(first)]


def _branch_error(errors: list[dict], loc: tuple, got) -> dict | None:
    """Of a union's branch errors, the one of the branch the input's type chose (a string for
    the string branch, a list for a list branch), the deepest such: `prompt[0][0]: Input should
    be a valid integer` says more than "none of four shapes matched"."""
    kind = "list" if isinstance(got, list) else "dict" if isinstance(got, dict) else "scalar"
    fitting = []
    for e in errors:
        e_loc = tuple(e.get("loc", ()))
        if len(e_loc) <= len(loc):
            continue
        tag = _readable(str(e_loc[len(loc)]))
        branch = "list" if tag.startswith("list[") else "dict" if tag[:1].isupper() else "scalar"
        if branch == kind and e.get("type") not in ("list_type", "string_type", "model_type", "dict_type"):
            fitting.append(e)
    if not fitting:
        return None
    return max(fitting, key=lambda e: len(e["loc"]))


def _shown(got) -> str:
    return (repr(got) if not isinstance(got, (dict, list)) else type(got).__name__)[:80]


def _field_message(error: dict, param: str | None) -> tuple[str | None, str]:
    got = error.get("input")
    if error.get("type") == "missing":
        return param, f"{param}: is required"
    if error.get("type") == "value_error":  # a validator's own message, which may name a sub-field
        text = str(error.get("ctx", {}).get("error", error.get("msg", "invalid value")))
        sub, sep, rest = text.partition(": ")
        if sep and (sub.isidentifier() or (isinstance(got, dict) and sub in got)):
            param, text = (f"{param}.{sub}" if param else sub), rest
        return param, (f"{param}: {text}" if param else text)
    return param, f"{param}: {error.get('msg', 'invalid value')} (got {_shown(got)})"


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request: "
                        f"{first.get('ctx', {}).get('error', 'malformed JSON')}. Send valid JSON.",
                        code="invalid_json")
    loc = _common_loc(errors) if errors else ()
    param = _loc_to_param(loc)
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:len(loc)] == loc]
    if first.get("type") == "model_attributes_type" and param is None:
        message = "the request body must be a JSON object"
    elif len(same_field) > 1 and len(loc) < len(tuple(first.get("loc", ()))):  # a union: no branch matched
        got = first.get("input")
        chosen = _branch_error(same_field, loc, got)
        if chosen is not None:
            rest = tuple(p for p in chosen["loc"][len(loc) + 1:] if not _is_union_tag(p))
            param, message = _field_message(chosen, _loc_to_param(loc + rest))
        else:
            branches = sorted({_readable(str(e["loc"][len(loc)])) for e in same_field if len(e["loc"]) > len(loc)})
            message = f"{param}: invalid value (got {_shown(got)}); expected one of: {', '.join(branches)}"
    else:
        param, message = _field_message(first, param)
    others = len(errors) - len(same_field)
    more = f" (and {others} more problem{'s' if others > 1 else ''})" if others > 0 else ""
    return APIError(400, message + more, param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, "internal server error; the server log has the details"),
                            status_code=500)
