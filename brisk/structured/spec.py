"""What a request asks the output to match, as one hashable value (no grammar library here).

Sources, at most one per request: OpenAI's `response_format` (`json_object`, `json_schema`),
vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` extras and its
newer `structured_outputs` object, and tool calls (`tool_choice: required` or a named function).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from brisk.errors import ParamError
from brisk.structured import limits

KINDS = ("json", "regex", "choice", "lark")
# `response_format: json_object`: any JSON object (OpenAI's JSON mode)
ANY_JSON_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    value: str  # canonical JSON schema, regex, JSON list of choices, or Lark source
    field: str  # the request field it came from, for error messages
    whitespace_pattern: str | None = None  # JSON only: a regex for the whitespace allowed between tokens

    @property
    def key(self) -> tuple[str, str, str | None]:
        return (self.kind, self.value, self.whitespace_pattern)


def json_spec(schema: Any, field: str, whitespace_pattern: str | None = None) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ParamError(field, f"is not valid JSON ({e.msg} at character {e.pos}); send a JSON schema "
                                    "object or its JSON text") from None
        except RecursionError:  # deeper than Python's parser goes
            raise limits.too_deep(field) from None
    limits.check_json_depth(schema, field)
    if isinstance(schema, bool):  # JSON Schema allows `true` (anything) and `false` (nothing)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ParamError(field, f"must be a JSON schema object, got {type(schema).__name__}")
    # key order kept: the output lists properties in the schema's order
    return GrammarSpec("json", json.dumps(schema, separators=(",", ":")), field, whitespace_pattern)


def choice_spec(choices: list[str], field: str) -> GrammarSpec:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ParamError(field, "must be a non-empty list of non-empty strings")
    return GrammarSpec("choice", json.dumps(list(dict.fromkeys(choices))), field)


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ParamError(field, "must be a non-empty string")
    return value


def from_request(body: Any) -> GrammarSpec | None:
    """The one grammar a chat/completions request asks for, or None. Two sources at once are an error
    (which one would win is a guess)."""
    found: list[GrammarSpec] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(json_spec(ANY_JSON_OBJECT, "response_format"))
        else:
            if rf.json_schema is None:
                raise ParamError("response_format.json_schema",
                                 "is required when type is 'json_schema' ({\"name\": ..., \"schema\": {...}})")
            schema = rf.json_schema.schema_
            found.append(json_spec(ANY_JSON_OBJECT if schema is None else schema,
                                   "response_format.json_schema.schema"))
    ws = getattr(body, "guided_whitespace_pattern", None)
    if getattr(body, "guided_json", None) is not None:
        found.append(json_spec(body.guided_json, "guided_json", ws))
    if getattr(body, "guided_regex", None) is not None:
        found.append(GrammarSpec("regex", _text(body.guided_regex, "guided_regex"), "guided_regex"))
    if getattr(body, "guided_choice", None) is not None:
        found.append(choice_spec(body.guided_choice, "guided_choice"))
    if getattr(body, "guided_grammar", None) is not None:
        found.append(GrammarSpec("lark", _text(body.guided_grammar, "guided_grammar"), "guided_grammar"))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        found += so_specs(so)
    if ws is not None and not any(s.kind == "json" and s.field == "guided_json" for s in found):
        raise ParamError("guided_whitespace_pattern", "applies to guided_json only; give guided_json too")
    if len(found) > 1:
        names = ", ".join(s.field for s in found)
        raise ParamError(found[1].field, f"a request takes one output constraint, got {len(found)} ({names}); "
                                         "keep one")
    return found[0] if found else None


def so_specs(so: Any) -> list[GrammarSpec]:
    """vLLM's `structured_outputs: {json | regex | choice | grammar | json_object}`."""
    out = []
    ws = so.whitespace_pattern
    if so.json_ is not None:
        out.append(json_spec(so.json_, "structured_outputs.json", ws))
    if so.json_object:
        out.append(json_spec(ANY_JSON_OBJECT, "structured_outputs.json_object", ws))
    if so.regex is not None:
        out.append(GrammarSpec("regex", _text(so.regex, "structured_outputs.regex"), "structured_outputs.regex"))
    if so.choice is not None:
        out.append(choice_spec(so.choice, "structured_outputs.choice"))
    if so.grammar is not None:
        out.append(GrammarSpec("lark", _text(so.grammar, "structured_outputs.grammar"), "structured_outputs.grammar"))
    if len(out) != 1:
        raise ParamError("structured_outputs", f"give exactly one of json, json_object, regex, choice, grammar; "
                                               f"got {len(out)}")
    if ws is not None and not (out and out[0].kind == "json"):
        raise ParamError("structured_outputs.whitespace_pattern", "applies to json and json_object only")
    return out
