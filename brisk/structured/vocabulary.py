"""The tokenizer as llguidance sees it, with its mask and its consume step agreeing on every token.

llguidance computes the mask from each token's bytes, but where the grammar forces bytes it tokenizes
them with the tokenizer itself and allows only the first token of that ("fast-forward"). Two kinds of
vocabulary make that tokenization disagree with the bytes, and then the mask allows a token that the
consume step rejects:

- Added tokens that are *not* special (Qwen3's `<think>`, `</think>`, `<tool_call>`: text a model
  writes). llguidance treats every added token as special (its bytes get a 0xFF marker), so a forced
  "<think>" tokenized to that token was allowed and then rejected (issue 61).
- Vocabularies that cannot write every byte: SmolLM2's byte-level vocabulary has no token for some
  bytes UTF-8 uses (0xF1 among them), and `tokenizers` silently drops a character it cannot write. A
  grammar forcing "\\U00040000" (F1 80 80 80) was fast-forwarded to the token for 0x80, which the
  grammar then rejected.

So where the vocabulary has either, llguidance gets the vocabulary token by token instead: each token's
bytes as llguidance itself decodes them, special only where the tokenizer says special, and a tokenize
step that checks its tokens spell exactly the bytes it was given. A non-special added token is then the
text it stands for, in the mask and in consume alike. Bytes no tokens spell make the tokenize step raise:
llguidance assumes a tokenization covers all the forced bytes (given fewer tokens, it masks as if the rest
had been written), so it must not get one; it catches the error and puts the matcher in error instead.
The sandbox then refuses a grammar that needs such text from its start (a 400, "matches no text this model
can write"), and the engine ends a request that reaches it with a `grammar_unsatisfiable` error.
Vocabularies with neither are handed over as the JSON, unchanged (no extra start-up time).
"""

from __future__ import annotations

from typing import Any

# bytes that can occur in UTF-8 text (grammars are text): all but 0xC0, 0xC1 and 0xF5-0xFF
UTF8_BYTES = frozenset(range(0xC0)) | frozenset(range(0xC2, 0xF5))


def text_added_tokens(fast: Any) -> set[int]:
    """Ids of the added tokens the tokenizer does not call special: text to a grammar."""
    return {i for i, token in fast.get_added_tokens_decoder().items() if not token.special}


def byte_tokens(base: Any, vocab_size: int) -> dict[int, int]:
    """Byte value -> the id of a token that is exactly that byte (not special), per llguidance's decoding."""
    found: dict[int, int] = {}
    for i in range(vocab_size):
        if not base.is_special_token(i):
            data = base.decode_bytes([i])
            if len(data) == 1 and data[0] not in found:
                found[data[0]] = i
    return found


def llg_tokenizer(fast: Any, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...]) -> Any:
    """An llguidance LLTokenizer for `fast` (a tokenizers.Tokenizer) over `vocab_size` ids (the model's,
    which may exceed the tokenizer's: the extra ids are special, never text)."""
    import llguidance

    eos = list(eos_token_ids)
    base = llguidance.LLTokenizer(fast.to_str(), n_vocab=vocab_size, eos_token=eos)
    text_tokens = {i for i in text_added_tokens(fast) if i < vocab_size and base.is_special_token(i)}
    if not text_tokens and UTF8_BYTES <= byte_tokens(base, vocab_size).keys():
        return base
    vocabulary = _Vocabulary(base, vocab_size, text_tokens, eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=eos)


class UnwritableText(ValueError):
    """Bytes the vocabulary has no tokens to spell."""


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each token's bytes, which ids are special, and a tokenize
    step (for the forced bytes) whose tokens always spell exactly its input."""

    def __init__(self, base: Any, vocab_size: int, text_tokens: set[int], eos: list[int]):
        self._base = base
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self.tokens = [base.decode_bytes([i]) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if base.is_special_token(i) and i not in text_tokens]

    def __call__(self, data: str | bytes) -> list[int]:
        if isinstance(data, str):
            data = data.encode("utf-8")
        # llguidance's own tokenizer (the `tokenizers` one, with a byte-wise tail for a cut character); its
        # ids for non-special added tokens are right, and are text in `self.tokens`
        ids = self._base.tokenize_bytes(data)
        if b"".join(self.tokens[i] for i in ids) != data:
            raise UnwritableText(f"no tokens of this vocabulary spell {data[:40]!r}")
        return ids
