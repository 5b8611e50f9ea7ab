"""Rebuild a `tokenizers` fast tokenizer and a tokenizer_config from GGUF metadata.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen2,
SmolLM2, ...) are supported. The pre-tokenizer is chosen from
`tokenizer.ggml.pre`, the same key llama.cpp uses to pick its splitting regex.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from brisk.errors import ModelLoadError

# llama.cpp's token types
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "llama3": lambda: _regex_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _regex_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_then_bytes(_QWEN2_SPLIT),
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
}


def build_tokenizer(meta: dict[str, Any], source: str) -> tuple[Tokenizer, dict[str, Any]]:
    """(fast tokenizer, tokenizer_config dict) from `tokenizer.*` GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{source}: GGUF tokenizer type {kind!r} is not supported (brisk reads byte-level BPE, 'gpt2'); "
            "use the model's Hugging Face directory instead"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(PRE_TOKENIZERS)}); "
            "use the model's Hugging Face directory instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, token_types) if kind_ == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind_ in zip(tokens, token_types) if kind_ == _USER_DEFINED])

    def token_at(key: str) -> str | None:
        idx = meta.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        specials = [(t, tokens.index(t)) for t in {bos if add_bos else None, eos if add_eos else None} if t]
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": add_bos,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tok, config
