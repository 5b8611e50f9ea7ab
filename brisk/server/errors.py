"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, one clear
message, never a stack trace. Every exception a route can raise ends here."""

from __future__ import annotations

import json
import logging
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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500 else
                                                              "invalid_request_error"),
                      "param": param, "code": code}}


def _loc_to_param(loc: tuple) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _is_union_tag(part) -> bool:
    """pydantic names the union member an error came from ('str', 'list[int]', 'TextPart')."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part
                                      or part[:1].isupper())


def _common_loc(errors: list[dict]) -> tuple:
    """The field all of a union's branch errors point at (the first error's field)."""
    first = tuple(errors[0].get("loc", ()))
    tag_at = next((i for i, p in enumerate(first) if _is_union_tag(p)), len(first))
    return first[:tag_at]


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
    got = first.get("input")
    shown = (repr(got) if not isinstance(got, (dict, list)) else type(got).__name__)[:80]
    if first.get("type") == "missing":
        message = f"{param}: is required"
    elif first.get("type") == "model_attributes_type" and param is None:
        message = "the request body must be a JSON object"
    elif len(same_field) > 1 and len(loc) < len(tuple(first.get("loc", ()))):  # a union: no branch matched
        branches = sorted({str(e["loc"][len(loc)]) for e in same_field if len(e["loc"]) > len(loc)})
        message = f"{param}: invalid value (got {shown}); expected one of: {', '.join(branches)}"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')} (got {shown})"
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
