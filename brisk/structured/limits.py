"""Bounds a grammar must meet before any grammar library sees it (no grammar library here).

The grammar library (llguidance, native code) recurses while it builds a matcher: a chain of
~1,000 `$ref`s or ~3,000 Lark rules overflowed an 8 MiB stack and took the server down with
it (benchmarks/grammar_limits.py finds each threshold). The checks below refuse such input with
a 400 naming the field and the limit, far below where the library breaks; the compile sandbox
(brisk/structured/sandbox.py) catches whatever still gets through. Each limit is many times what
real schemas and grammars use: OpenAI's strict mode allows 5 levels of nesting and 5,000
properties; JSON Schema Store's largest schemas nest about 20 levels.
"""

from __future__ import annotations

import re
from typing import Any

from brisk.errors import ParamError

# Nesting of the schema document itself (llguidance's JSON reader refuses more than ~128).
MAX_JSON_DEPTH = 100
# Schema levels with every `$ref` expanded (a recursive `$ref` counts once): the ref chain that
# crashed was 1,000 long (two levels per link); the sandbox's 4 MiB stack held 459 links, brisk accepts 63.
MAX_SCHEMA_DEPTH = 128
MAX_SCHEMA_NODES = 50_000
# Optional properties compile in time quadratic in their number (1,000: 0.24 s, 2,000: 0.95 s,
# 5,000: ~5 s here, and the server compiles twice: in the sandbox, then for itself).
MAX_OBJECT_PROPERTIES = 1_000
MAX_REGEX_CHARS = 32_768
MAX_GRAMMAR_CHARS = 1 << 20
# A chain of 3,000 rules crashed an 8 MiB stack (1,329 the sandbox's 4 MiB one); real grammars (SQL, C in
# GBNF) have a few hundred.
MAX_GRAMMAR_RULES = 500
MAX_CHOICES = 10_000


class GrammarError(ParamError):
    """The grammar (schema, regex, Lark) cannot be compiled; names the request field."""


class GrammarLimitError(GrammarError):
    """The grammar is over one of the bounds above."""


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            return depth  # enough to refuse; the rest need not be walked
        stack.extend((child, depth + 1) for child in children)
    return deepest


def too_deep(field: str) -> GrammarLimitError:
    return GrammarLimitError(field, f"the schema nests deeper than {MAX_JSON_DEPTH} levels of JSON; "
                                    "flatten it (use $defs and $ref for repeated parts)")


def check_json_depth(schema: Any, field: str) -> None:
    if json_depth(schema) > MAX_JSON_DEPTH:
        raise too_deep(field)


def check_schema(schema: Any, field: str) -> None:
    """Refuse schemas too deep or too large to compile, and schemas no finite value matches."""
    check_json_depth(schema, field)
    graph = _SchemaGraph(schema)
    if graph.most_properties > MAX_OBJECT_PROPERTIES:
        raise GrammarLimitError(field, f"an object of the schema lists {graph.most_properties} properties, over the "
                                       f"limit of {MAX_OBJECT_PROPERTIES}; group them into nested objects")
    if graph.num_nodes > MAX_SCHEMA_NODES:
        raise GrammarLimitError(field, f"the schema has {graph.num_nodes} subschemas, over the limit of "
                                       f"{MAX_SCHEMA_NODES}; split the request or simplify the schema")
    expanded = graph.expanded_depth()
    if expanded > MAX_SCHEMA_DEPTH:
        raise GrammarLimitError(field, f"the schema nests more than {MAX_SCHEMA_DEPTH} levels deep once its $refs "
                                       "are followed; shorten the chain of $refs")
    if not graph.has_finite_instance():
        raise GrammarLimitError(field, "no finite JSON value matches this schema (a required property or $ref "
                                       "leads back to itself, or an empty enum/anyOf); fix the schema")


def check_regex(pattern: str, field: str) -> None:
    if len(pattern) > MAX_REGEX_CHARS:
        raise GrammarLimitError(field, f"the pattern is {len(pattern)} characters, over the limit of "
                                       f"{MAX_REGEX_CHARS}")


def check_choices(choices: list[str], field: str) -> None:
    if len(choices) > MAX_CHOICES:
        raise GrammarLimitError(field, f"{len(choices)} choices, over the limit of {MAX_CHOICES}")


_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?[0-9]+)?[ \t]*:", re.MULTILINE)


def check_lark(source: str, field: str) -> None:
    if len(source) > MAX_GRAMMAR_CHARS:
        raise GrammarLimitError(field, f"the grammar is {len(source)} characters, over the limit of "
                                       f"{MAX_GRAMMAR_CHARS}")
    rules = len(_LARK_RULE.findall(source))
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarLimitError(field, f"the grammar has {rules} rules, over the limit of {MAX_GRAMMAR_RULES}; "
                                       "merge rules or split the task")


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _children(node: dict) -> list[Any]:
    out: list[Any] = []
    for key in _SUBSCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            out.extend(value.values())
    for key in _SUBSCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            out.extend(value)
    for key in _SUBSCHEMA_ONE:
        value = node.get(key)
        if isinstance(value, (dict, bool)):
            out.append(value)
        elif key == "items" and isinstance(value, list):  # draft-04 tuple form
            out.extend(value)
    return out


class _SchemaGraph:
    """A schema document with its local `$ref`s ("#", "#/$defs/x", any JSON pointer) resolved."""

    def __init__(self, root: Any):
        self.root = root
        self.num_nodes = self.most_properties = 0
        stack = [root]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                self.num_nodes += 1
                if isinstance(node.get("properties"), dict):
                    self.most_properties = max(self.most_properties, len(node["properties"]))
                if self.num_nodes > MAX_SCHEMA_NODES:
                    break
                stack.extend(_children(node))

    def resolve(self, ref: Any) -> Any | None:
        """The subschema a local ref points to, or None (remote, malformed: the library reports it)."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def expanded_depth(self) -> int:
        """Deepest chain of subschemas, entering each `$ref` target once per path (a recursive
        schema is a loop the library compiles once, not an endless chain)."""
        memo: dict[str, int] = {}

        def depth(node: Any, on_path: frozenset[str], level: int) -> int:
            if not isinstance(node, dict) or level > MAX_SCHEMA_DEPTH:
                return 0
            deepest = 0
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in on_path:
                if ref not in memo:
                    target = self.resolve(ref)
                    memo[ref] = depth(target, on_path | {ref}, level + 1) if target is not None else 0
                deepest = memo[ref]
            for child in _children(node):
                deepest = max(deepest, depth(child, on_path, level + 1))
            return 1 + deepest

        return depth(self.root, frozenset(), 0)

    def has_finite_instance(self) -> bool:
        """Whether some finite JSON value can match (a least fixpoint over the `$ref` targets: a ref
        is productive once its target is, assuming nothing about refs still being decided)."""
        productive: set[str] = set()
        while True:
            found = [ref for ref in self._refs() if ref not in productive
                     and self._productive(self.resolve(ref), productive)]
            if not found:
                return self._productive(self.root, productive)
            productive.update(found)

    def _refs(self) -> list[str]:
        refs, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("$ref"), str) and self.resolve(node["$ref"]) is not None:
                    refs.append(node["$ref"])
                stack.extend(_children(node))
        return list(dict.fromkeys(reversed(refs)))  # innermost first: a chain settles in one pass

    def _productive(self, node: Any, productive_refs: set[str]) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True  # not a schema the check understands: the library decides
        ref = node.get("$ref")
        if isinstance(ref, str) and self.resolve(ref) is not None and ref not in productive_refs:
            return False
        if node.get("enum") == [] or node.get("type") == []:
            return False
        if isinstance(node.get("allOf"), list) and not all(self._productive(s, productive_refs) for s in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and not any(self._productive(s, productive_refs) for s in node[key]):
                return False
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if not all(self._productive(properties[name], productive_refs) for name in required
                   if isinstance(name, str) and name in properties):
            return False
        min_items = node.get("minItems", 0)
        if isinstance(min_items, int) and min_items > 0:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            needed = prefix[:min_items]
            if len(prefix) < min_items and isinstance(node.get("items"), (dict, bool)):
                needed = needed + [node["items"]]
            if not all(self._productive(s, productive_refs) for s in needed):
                return False
        return True
