"""The rules a brisk request must meet that no JSON schema can state, applied to schemathesis'
positive (schema-valid) cases so that only the document's own truth is tested:

- the prompt plus max_tokens fits the context window, and the prompt is at least one token (properties
  of the prompt's tokens, counted with the server's /tokenize: a control character may be none);
  generation is kept short (max_tokens at most MAX_NEW);
- an output constraint compiles (whether a string is a valid regex, a JSON schema llguidance can
  compile, or JSON text at all is not a JSON-schema property): replaced by a valid one of its kind;
- tools' function names are unique, and a named tool_choice names one of them.

Every other rule is in /openapi.json. Used by tests/test_server_fuzz.py, and by the long
schemathesis CLI run (`SCHEMATHESIS_HOOKS=schemathesis_hooks` with tests/ on PYTHONPATH)."""

from __future__ import annotations

import httpx
import schemathesis
from schemathesis import GenerationMode

MAX_NEW = 4
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
VALID = {"guided_json": {"type": "object"}, "guided_regex": "[a-z]{1,3}", "guided_grammar": 'start: "ok"',
         "guided_choice": ["a", "b"]}
VALID_SO = {"json": {"type": "object"}, "regex": "[a-z]{1,3}", "grammar": 'start: "ok"', "choice": ["a", "b"]}


def make_compilable(body: dict) -> None:
    """The request's one output constraint (the document allows one at most) made valid."""
    for key, value in VALID.items():
        if body.get(key) is not None:
            body[key] = value
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
        rf["json_schema"]["schema"] = {"type": "object"}
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        for key, value in VALID_SO.items():
            if so.get(key) is not None:
                so[key] = value
        if so.get("whitespace_pattern") is not None:
            so["whitespace_pattern"] = " "
    if body.get("guided_whitespace_pattern") is not None:
        body["guided_whitespace_pattern"] = " "
    tools, choice = body.get("tools"), body.get("tool_choice")
    for i, tool in enumerate(tools or []):
        tool["function"]["name"] = f"{tool['function']['name'][:50]}_{i}"
    if isinstance(choice, dict) and tools:
        choice.setdefault("function", {})["name"] = tools[0]["function"]["name"]
    for tool in tools or []:
        tool["function"]["parameters"] = {"type": "object", "properties": {"x": {"type": "integer"}}}


def responses_fit(body: dict, http: httpx.Client, window: int) -> bool:
    """A Responses case: its constraint and tools made valid (as for chat), max_output_tokens bounded, and
    whether the chat it is computed as (brisk's own conversion) fits the window."""
    from brisk.server.responses_api import ResponsesRequest, chat_request

    if isinstance(body.get("max_output_tokens"), (int, float)):
        body["max_output_tokens"] = min(int(body["max_output_tokens"]), MAX_NEW)
    else:
        body["max_output_tokens"] = MAX_NEW
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt["schema"] = {"type": "object"}
    tools, choice = body.get("tools"), body.get("tool_choice")
    for i, tool in enumerate(tools or []):
        tool["name"] = f"{tool['name'][:50]}_{i}"
        tool["parameters"] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    if isinstance(choice, dict) and tools:
        choice["name"] = tools[0]["name"]
    try:
        chat, _ = chat_request(ResponsesRequest.model_validate(body), [])
    except Exception:  # noqa: BLE001 - a request the server refuses with a 400 the document lists
        return True
    counted = http.post("/tokenize", json={"messages": [m.model_dump(exclude_none=True) for m in chat.messages],
                                           "tools": [t.model_dump(exclude_none=True) for t in chat.tools or []] or None})
    return counted.status_code != 200 or 1 <= counted.json()["count"] <= window - body["max_output_tokens"]


def fits_window(path: str, body: dict, http: httpx.Client, window: int) -> bool:
    """Bound max_tokens, and whether the prompt and max_tokens fit the window."""
    if path == "/v1/responses":
        return responses_fit(body, http, window)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), (int, float)):  # JSON Schema's integers include 3.0
            body[key] = min(int(body[key]), MAX_NEW)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW
    if path == "/v1/chat/completions":
        counted = http.post("/tokenize", json={"messages": body["messages"], "tools": body.get("tools"),
                                               "chat_template_kwargs": body.get("chat_template_kwargs")})
        counts = [counted.json()["count"]] if counted.status_code == 200 else None
    else:
        prompt = body["prompt"]
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            texts = [prompt] if isinstance(prompt, str) else prompt
            counts = [http.post("/tokenize", json={"prompt": t}).json()["count"] for t in texts]
        else:
            counts = [len(prompt)] if isinstance(prompt[0], (int, float)) else [len(p) for p in prompt]
    if counts is None:
        return True  # e.g. the chat template refuses these messages: a 400 the document lists
    new = body.get("max_completion_tokens") or body.get("max_tokens")
    return min(counts) >= 1 and max(counts) + new <= window


def fit_positive_case(path: str, body: dict, http: httpx.Client, window: int) -> bool:
    """Apply the rules above to a positive generation case; False if its prompt cannot fit the window."""
    if path != "/v1/responses":
        make_compilable(body)
    return fits_window(path, body, http, window)


@schemathesis.hook
def filter_case(ctx, case) -> bool:
    """CLI runs: keep positive generation cases only when the rules can be met (the window)."""
    if case.path not in GENERATION_ROUTES or case.meta is None or \
            case.meta.generation.mode is not GenerationMode.POSITIVE or not isinstance(case.body, dict):
        return True
    base = case.operation.schema.get_base_url()
    with httpx.Client(base_url=base, timeout=60) as http:
        window = http.get("/v1/models").json()["data"][0]["max_model_len"]
        return fit_positive_case(case.path, case.body, http, window)
