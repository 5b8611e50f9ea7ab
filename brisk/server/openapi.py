"""The OpenAPI document, made to describe the server as it behaves:

- errors are 400 (not FastAPI's 422) with OpenAI's error body, and every status a route
  can send is listed (401 with an API key, 404 for an unknown model, 408/413 from the
  body limits, 429 when the queue is full, 503 while loading or draining, 504 on timeout);
- `/metrics` is Prometheus text, and the generation routes stream `text/event-stream`;
- limits only known once the model is loaded (vocabulary size, context window, capacity)
  are written into the request schemas, so a request the schema calls valid is one the
  server can accept; until then the document is rebuilt on every call, not cached.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from brisk.metrics.prometheus import CONTENT_TYPE
from brisk.server.context_guard import ContextPolicy
from brisk.server.middleware import PUBLIC_PATHS
from brisk.server.embeddings import EmbeddingRequest
from brisk.server.responses_api import ResponsesRequest
from brisk.structured.tools import renders_tool_calls
from brisk.server.protocol import (CHOICES_MARK, MAX_CHOICES, MAX_TOKENS_MARK, TOKEN_ID_KEY_MARK, TOKEN_ID_MARK,
                                   ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse,
                                   TokenizeRequest)

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_STATUS_BODY = {"type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}
_REASONS = {400: "Invalid request (the message names the field)", 401: "Missing or wrong API key",
            404: "Unknown model", 408: "The request body did not arrive in time (--body-timeout)",
            413: "Request body or prompt over the server's limits", 429: "Queue full; retry after Retry-After",
            503: "Model loading, engine stopped, or server draining", 504: "Ran past --request-timeout"}
_BODY_ROUTES = {"/v1/models/{model_id}": (404,), "/v1/responses/{response_id}": (404,),
                "/v1/responses": (400, 404, 408, 413, 429, 503, 504),
                "/v1/embeddings": (400, 404, 408, 413, 429, 503, 504),
                "/tokenize": (400, 404, 408, 413, 503),
                "/detokenize": (400, 404, 408, 413, 503),
                "/v1/chat/completions": (400, 404, 408, 413, 429, 503, 504),
                "/v1/completions": (400, 404, 408, 413, 429, 503, 504)}
_STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_BODIES = {m.__name__: m for m in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest,
                                   ResponsesRequest, EmbeddingRequest)}
# One server-sent event: `data` is a JSON chunk, an error object, or the final "[DONE]".
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
              "required": ["data"]}


def request_body(model) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body, read by brisk/server/bodies.py rather than FastAPI (so
    that large bodies are parsed off the event loop), described as FastAPI would describe it."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}, "x-brisk-body": model.__name__}


def install_openapi(app: FastAPI, state) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build(app, state)
        if state.engine is not None:  # the limits are known: the document no longer changes
            app.openapi_schema = doc
        return doc

    app.openapi = openapi


def build(app: FastAPI, state) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of a brisk server")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for methods in doc["paths"].values():
        for op in methods.values():
            model = _BODIES.get(op.pop("x-brisk-body", None))
            if model is not None:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    key = state.config.api_key is not None
    if key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, methods in doc["paths"].items():
        for op in methods.values():
            responses = op["responses"]
            responses.pop("422", None)
            for status in _BODY_ROUTES.get(path, ()):
                responses[str(status)] = _error_response(status)
            if path in ("/health", "/ready"):
                for status in ("200", "503"):
                    responses[status] = {"description": "status" if status == "200" else _REASONS[503],
                                         "content": {"application/json": {"schema": _STATUS_BODY}}}
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text exposition",
                                    "content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}}
            if path in _STREAMING:
                responses["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
            if key and path not in PUBLIC_PATHS and not (path == "/metrics" and state.config.metrics_public):
                op["security"] = [{"bearer": []}]
                responses["401"] = _error_response(401)
    _fill_limits(doc, state)
    if state.engine is not None:
        _what_the_template_renders(schemas, state.tokenizer)
        _prompts_times_choices(schemas["CompletionRequest"], state.capacity)
        _what_the_model_serves(schemas, state.engine.pooling)
    return doc


def _prompts_times_choices(schema: dict[str, Any], capacity: int) -> None:
    """ServerState.check_prompt_list's rule: a list of prompts holds up to `capacity` of them with n = 1
    (or n absent), up to capacity // MAX_CHOICES with any n (a prompt given as text or ids is one)."""
    def listing(count: int) -> dict[str, Any]:
        return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                          {"type": "array", "maxItems": count}]}

    schema.setdefault("allOf", []).append({"anyOf": [
        {"properties": {"n": {"maximum": 1}, "prompt": listing(capacity)}},
        {"properties": {"prompt": listing(capacity // min(MAX_CHOICES, capacity))}}]})


def _what_the_model_serves(schemas: dict[str, Any], pooling) -> None:
    """A generative model takes no embedding request, an embedding model no generation request (a 400 either way):
    the document says so."""
    refused = ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest") if pooling is not None \
        else ("EmbeddingRequest",)
    for name in refused:
        if name in schemas:
            schemas[name]["not"] = {}
            schemas[name]["description"] = ("this server's model is an embedding model: it serves /v1/embeddings"
                                            if pooling is not None else "this server's model is generative")


def _what_the_template_renders(schemas: dict[str, Any], tokenizer) -> None:
    """A chat template that renders no tools (or no earlier tool calls) makes requests with them a 400:
    the document says so, rather than calling them valid."""
    if "tools" not in tokenizer.template_variables:
        for name in ("ChatCompletionRequest", "TokenizeRequest"):
            schemas[name]["properties"]["tools"] = {"type": "null",
                                                    "description": "this model's chat template renders no tools"}
        schemas["ChatCompletionRequest"]["properties"]["tool_choice"] = {"enum": [None, "none"]}
    if "tools" not in tokenizer.template_variables and "ResponsesRequest" in schemas:
        schemas["ResponsesRequest"]["properties"]["tools"] = {"type": "null",
                                                              "description": "this model's chat template renders no tools"}
        schemas["ResponsesRequest"]["properties"]["tool_choice"] = {"enum": [None, "none"]}
    if not renders_tool_calls(tokenizer.chat_template_source):
        schemas["ChatMessage"]["properties"]["tool_calls"] = {
            "type": "null", "description": "this model's chat template renders no tool calls"}
        if "ResponsesFunctionCall" in schemas:  # a Responses input's earlier calls
            schemas["ResponsesFunctionCall"]["not"] = {}
    variables = tokenizer.template_variables
    if "reasoning_effort" not in variables and "enable_thinking" not in variables:
        note = {"type": "null", "description": "this model's chat template reads no reasoning effort"}
        for name in ("ChatCompletionRequest", "TokenizeRequest"):
            schemas[name]["properties"]["reasoning_effort"] = note
        if "ResponsesReasoningConfig" in schemas:
            schemas["ResponsesReasoningConfig"]["properties"]["effort"] = note


def _error_response(status: int) -> dict[str, Any]:
    return {"description": _REASONS[status], "content": {"application/json": {"schema": _ERROR_REF}}}


def _fill_limits(node: Any, state) -> None:
    """Replace the protocol's markers by the loaded model's limits (or just drop them)."""
    if isinstance(node, list):
        for item in node:
            _fill_limits(item, state)
        return
    if not isinstance(node, dict):
        return
    ready = state.engine is not None
    if node.pop(TOKEN_ID_MARK, False) and ready:
        node["maximum"] = state.engine.vocab_size - 1
    names = node.get("propertyNames")
    if isinstance(names, dict) and names.pop(TOKEN_ID_KEY_MARK, False):
        # pydantic writes a constrained key as patternProperties, which lets other keys through:
        # say instead that every key is a token id (inside the vocabulary once it is known)
        (general, values), = node.pop("patternProperties").items()
        node["propertyNames"] = {"pattern": below_pattern(state.engine.vocab_size)
                                 if ready else general}
        node["additionalProperties"] = values
    if node.pop(MAX_TOKENS_MARK, False) and ready and state.config.context_policy is not ContextPolicy.CLAMP_MAX_TOKENS:
        node["maximum"] = state.max_model_len - 1  # a prompt has at least one token
    if node.pop(CHOICES_MARK, False) and ready:
        node["maximum"] = min(node.get("maximum", state.capacity), state.capacity)
    for value in node.values():
        _fill_limits(value, state)


def below_pattern(n: int) -> str:
    """A regex for the decimal integers 0 .. n-1, without leading zeros (n >= 1)."""
    top = str(n - 1)
    alternatives = ["[0-9]"] if len(top) > 1 else []
    if len(top) > 2:
        alternatives.append(f"[1-9][0-9]{{1,{len(top) - 2}}}")
    for i, digit in enumerate(top):  # same length as n-1: equal up to i, smaller at i, anything after
        low = "1" if i == 0 and len(top) > 1 else "0"
        if digit > low:
            high = chr(ord(digit) - 1)
            rest = len(top) - i - 1
            alternatives.append(top[:i] + (f"[{low}-{high}]" if high != low else low)
                                + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"
