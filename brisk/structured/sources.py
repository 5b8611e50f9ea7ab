"""A `GrammarSpec` as the grammar text llguidance compiles, after the bounds of `limits` are met.

Runs in the compile sandbox's worker process (brisk/structured/sandbox.py): the converters are
native code too, and the JSON schema converter is where a deep schema overflowed its stack.
"""

from __future__ import annotations

import json

from brisk.structured import limits
from brisk.structured.limits import GrammarError
from brisk.structured.spec import GrammarSpec

# JSON output without free whitespace: a small model given "any whitespace" can pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_limits(spec: GrammarSpec) -> None:
    """The bounds of `limits` for this kind of grammar (pure Python: the server checks them before the
    sandbox sees the grammar)."""
    if spec.kind == "json":
        limits.check_schema(json.loads(spec.value), spec.field)
    elif spec.kind == "regex":
        limits.check_regex(spec.value, spec.field)
    elif spec.kind == "choice":
        limits.check_choices(json.loads(spec.value), spec.field)
    elif spec.kind == "lark":
        limits.check_lark(spec.value, spec.field)


def grammar_source(spec: GrammarSpec) -> str:
    """The grammar text llguidance's matcher takes; GrammarError names the field when it is not valid."""
    import llguidance

    LLMatcher = llguidance.LLMatcher
    if spec.kind == "json":
        overrides = {"whitespace_pattern": spec.whitespace_pattern} if spec.whitespace_pattern else None
        try:
            return LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS, overrides=overrides)
        except ValueError as e:
            raise GrammarError(spec.field, f"is not a usable JSON schema: {short(str(e))}") from None
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in json.loads(spec.value))
        return LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if spec.kind == "lark":
        source = spec.value
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark, is_lark_syntax

        if "::=" in source and not is_lark_syntax(source):  # GBNF (llama.cpp's and xgrammar's format)
            try:
                source = gbnf_to_lark(source)
            except (GbnfToLarkError, ValueError, KeyError, IndexError, RecursionError) as e:
                raise GrammarError(spec.field, f"is not a valid GBNF grammar: {short(str(e))}") from None
            limits.check_lark(source, spec.field)
        return LLMatcher.grammar_from_lark(source)
    raise GrammarError(spec.field, f"unknown grammar kind {spec.kind!r}")


def short(message: str, limit: int = 500) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."
