"""The tokenizer as llguidance sees it, with its mask and its consume step agreeing on every token.

llguidance reads a `tokenizers` JSON and treats every added token as special: its bytes get a 0xFF
marker, so grammar text can never be made of it. Added tokens that are *not* special (Qwen3's `<think>`,
`</think>`, `<tool_call>`: text a model writes) are ordinary text to the tokenizer, and llguidance's
fast-forward of forced bytes tokenizes a forced "<think>" with the tokenizer itself: the mask then allows
that one token while `consume_token` rejects it (its 0xFF byte fails the grammar). A constrained reply
then ended after one token with an empty answer (issue 61).

So where the vocabulary has such tokens, llguidance gets the vocabulary token by token instead: each
token's bytes as llguidance itself decodes them, special only where the tokenizer says special. Then a
non-special added token is the text it stands for, in the mask and in consume alike. Vocabularies
without them are handed over as the JSON, unchanged (nothing to fix, no extra start-up time).
"""

from __future__ import annotations

from typing import Any


def text_added_tokens(fast: Any) -> set[int]:
    """Ids of the added tokens the tokenizer does not call special: text to a grammar."""
    return {i for i, token in fast.get_added_tokens_decoder().items() if not token.special}


def llg_tokenizer(fast: Any, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...]) -> Any:
    """An llguidance LLTokenizer for `fast` (a tokenizers.Tokenizer) over `vocab_size` ids (the model's,
    which may exceed the tokenizer's: the extra ids are special, never text)."""
    import llguidance

    eos = list(eos_token_ids)
    base = llguidance.LLTokenizer(fast.to_str(), n_vocab=vocab_size, eos_token=eos)
    text_tokens = {i for i in text_added_tokens(fast) if i < vocab_size and base.is_special_token(i)}
    if not text_tokens:
        return base
    vocabulary = _Vocabulary(fast, base, vocab_size, text_tokens, eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=eos)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each token's bytes, which ids are special, and the
    tokenizer itself (for the forced bytes it tokenizes)."""

    def __init__(self, fast: Any, base: Any, vocab_size: int, text_tokens: set[int], eos: list[int]):
        self._fast = fast
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self.tokens = [base.decode_bytes([i]) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if base.is_special_token(i) and i not in text_tokens]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._fast.encode(text, add_special_tokens=False).ids
