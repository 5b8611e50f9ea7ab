"""Structured outputs: JSON schema, regex, choice and Lark grammars as per-token masks.

`spec` turns request fields into a `GrammarSpec` (no grammar library imported);
`compiler` compiles specs with llguidance, off the engine's step loop, and caches them;
`bitmask` applies the allowed-token masks to the rows of a batch that have a grammar.
"""
