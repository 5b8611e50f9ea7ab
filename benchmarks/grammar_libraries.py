"""Why llguidance: the three grammar libraries made for structured outputs, on the demo
tokenizer (49,152 tokens) and one JSON schema, timed the way the engine uses them:
wrap the tokenizer once, compile the schema, then per generated token compute the mask,
apply it to a row of logits and advance with the token. The tokens are a valid reply's.

xgrammar and outlines-core are not brisk dependencies; install them to compare
(`pip install outlines-core; pip install --no-deps xgrammar apache-tvm-ffi`: xgrammar
requires transformers and triton at run time). A library that is missing is skipped.

    .venv/bin/python benchmarks/grammar_libraries.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from brisk.loading.loader import load

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "status": {"enum": ["active", "inactive", "banned"]}},
    "required": ["name", "age", "email", "tags", "address", "status"], "additionalProperties": False}
REPLY = {"name": "Alice Smith", "age": 42, "email": "alice@example.com", "tags": ["admin", "ops", "on call"],
         "address": {"city": "Paris", "zip": "75001"}, "status": "active"}


def llguidance_lib(tok, vocab, eos):
    import llguidance

    from brisk.structured.bitmask import fill_bitmask, unpack

    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.fast.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t

    def step(logits, token):
        logits.masked_fill_(unpack(~fill_bitmask([matcher], vocab), vocab)[0], float("-inf"))
        assert matcher.consume_token(token), matcher.get_error()
    return setup, compile_s, step


def xgrammar_lib(tok, vocab, eos):
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo([tok.token_bytes(i) for i in range(vocab)], vocab_type=xgr.VocabType.RAW,
                             vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
    compile_s = time.perf_counter() - t

    def step(logits, token):
        matcher.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits[None], bitmask)
        assert matcher.accept_token(token)
    return setup, compile_s, step


def outlines_lib(tok, vocab, eos):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    from brisk.structured.bitmask import unpack

    t = time.perf_counter()
    pieces: dict[bytes, list[int]] = {}
    for i in range(vocab):
        if i != eos:
            pieces.setdefault(tok.token_bytes(i), []).append(i)
    vocabulary = Vocabulary(eos, pieces)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary))
    compile_s = time.perf_counter() - t
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

    def step(logits, token):
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        logits.masked_fill_(unpack(~mask, vocab)[0], float("-inf"))
        if token != eos:
            guide.advance(token)
    return setup, compile_s, step


def main() -> None:
    loaded = load()
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    eos = tok.eos_token_ids[0]
    tokens = tok.encode(json.dumps(REPLY, separators=(",", ":")), add_special_tokens=False) + [eos]
    print(f"{len(tokens)} tokens of a valid reply; vocabulary {vocab}")
    print("| library | tokenizer setup (once) | schema compile | first mask | per token median | p90 | max |")
    print("|---|---|---|---|---|---|---|")
    for name, build in (("llguidance", llguidance_lib), ("xgrammar", xgrammar_lib), ("outlines-core", outlines_lib)):
        try:
            setup, compile_s, step = build(tok, vocab, eos)
        except ImportError as e:
            print(f"| {name} | not installed ({e.name}) | | | | | |")
            continue
        times = []
        for token in tokens:
            logits = torch.randn(vocab)
            t = time.perf_counter()
            step(logits, token)
            times.append(time.perf_counter() - t)
        q = statistics.quantiles(times[1:], n=10)
        print(f"| {name} | {setup * 1e3:.0f} ms | {compile_s * 1e3:.1f} ms | {times[0] * 1e3:.1f} ms | "
              f"{statistics.median(times[1:]) * 1e3:.2f} ms | {q[-1] * 1e3:.2f} ms | {max(times[1:]) * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
