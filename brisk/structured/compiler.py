"""Compiles a `GrammarSpec` into an llguidance matcher, once per distinct spec (LRU cache).

Why llguidance (benchmarks/grammar_libraries.py, RESULTS.md): on this CPU its per-token mask
costs the same as xgrammar's (0.2-0.3 ms for a 49k vocabulary) while a new JSON schema compiles
in milliseconds once the tokenizer is wrapped (outlines-core builds a full DFA index per schema:
~1 s, p90 2 ms per token); and it needs no other package (xgrammar requires transformers and
triton at run time). Compiling happens in a worker thread, never on the engine's step loop; the
engine forks one matcher per sequence from the cached one (`CompiledGrammar.matcher`).

A new grammar is first held to the bounds of `limits`, then tried in the compile sandbox's
worker process (a grammar that crashes the library kills only that worker), then built here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from brisk.structured.sandbox import BUILD_STACK_BYTES, CompileSandbox, run_with_stack
from brisk.structured.sources import GrammarError, check_limits, short
from brisk.structured.spec import ANY_JSON_OBJECT, GrammarSpec, json_spec
from brisk.structured.vocabulary import llg_tokenizer

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError"]

log = logging.getLogger("brisk.structured")

CACHE_SIZE = 256


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
        self._tokenizer_json = fast_tokenizer.to_str()
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self.sandbox = CompileSandbox(self._tokenizer_json, vocab_size, eos_token_ids)

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llg_tokenizer(self._fast, self.vocab_size, self.eos_token_ids)
            return self._tokenizer

    def warm_up(self) -> float:
        """Wrap the tokenizer and compute one mask: llguidance's first mask in a process builds its
        lexer tables (1.6-1.9 s measured here), which no request should wait for. Returns seconds."""
        t0 = time.perf_counter()
        from brisk.structured.bitmask import allowed_tokens

        self.sandbox.start()
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
        check_limits(spec)
        grammar = self.sandbox.check(spec)
        template = run_with_stack(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0),
                                  BUILD_STACK_BYTES, "brisk-grammar-build")
        if template.is_error():
            raise GrammarError(spec.field, f"cannot be compiled: {short(template.get_error())}")
        compiled = CompiledGrammar(spec, template, (time.perf_counter() - t0) * 1e3)
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        """Stop the sandbox's worker process (a later compile starts a new one)."""
        self.sandbox.close()
