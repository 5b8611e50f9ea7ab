"""Compiles a `GrammarSpec` into an llguidance matcher, once per distinct spec (LRU cache).

Why llguidance (benchmarks/grammar_libraries.py, RESULTS.md): on this CPU its per-token mask
costs the same as xgrammar's (0.2-0.3 ms for a 49k vocabulary) while a new JSON schema compiles
in milliseconds once the tokenizer is wrapped (outlines-core builds a full DFA index per schema:
~1 s, p90 2 ms per token); and it needs no other package (xgrammar requires transformers and
triton at run time). Compiling happens in a worker thread, never on the engine's step loop; the
engine forks one matcher per sequence from the cached one (`CompiledGrammar.matcher`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from brisk.engine.sampling_params import ParamError
from brisk.structured.spec import ANY_JSON_OBJECT, GrammarSpec, json_spec

log = logging.getLogger("brisk.structured")

CACHE_SIZE = 256
# JSON output without free whitespace: a small model given "any whitespace" can pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ParamError):
    """The grammar (schema, regex, Lark) cannot be compiled; names the request field."""


@dataclass
class CompiledGrammar:
    spec: GrammarSpec
    template: Any  # an LLMatcher in its start state; never advanced
    compile_ms: float

    def matcher(self) -> Any:
        """A fresh matcher for one sequence (a copy of the compiled start state: no recompilation)."""
        return self.template.deep_copy()


class GrammarCompiler:
    """One per served model: the tokenizer wrapped for llguidance (built once, ~0.5 s) and the cache."""

    def __init__(self, fast_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._fast = fast_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()

    def _llg_tokenizer(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._fast.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=list(self.eos_token_ids))
            return self._tokenizer

    def warm_up(self) -> float:
        """Wrap the tokenizer and compute one mask: llguidance's first mask in a process builds its
        lexer tables (1.6-1.9 s measured here), which no request should wait for. Returns seconds."""
        t0 = time.perf_counter()
        from brisk.structured.bitmask import allowed_tokens

        compiled = self.compile(json_spec(ANY_JSON_OBJECT, "warm-up"))
        allowed_tokens(compiled.matcher(), self.vocab_size)
        return time.perf_counter() - t0

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking (up to ~1 s for a huge grammar): call it from a worker thread."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        import llguidance

        tokenizer = self._llg_tokenizer()
        t0 = time.perf_counter()
        grammar = _grammar_source(spec)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(spec.field, f"cannot be compiled: {_short(template.get_error())}")
        compiled = CompiledGrammar(spec, template, (time.perf_counter() - t0) * 1e3)
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def _grammar_source(spec: GrammarSpec) -> str:
    import llguidance

    LLMatcher = llguidance.LLMatcher
    if spec.kind == "json":
        overrides = {"whitespace_pattern": spec.whitespace_pattern} if spec.whitespace_pattern else None
        try:
            return LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS, overrides=overrides)
        except ValueError as e:
            raise GrammarError(spec.field, f"is not a usable JSON schema: {_short(str(e))}") from None
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
            except (GbnfToLarkError, ValueError, KeyError, IndexError) as e:
                raise GrammarError(spec.field, f"is not a valid GBNF grammar: {_short(str(e))}") from None
        return LLMatcher.grammar_from_lark(source)
    raise GrammarError(spec.field, f"unknown grammar kind {spec.kind!r}")


def _short(message: str, limit: int = 500) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."
