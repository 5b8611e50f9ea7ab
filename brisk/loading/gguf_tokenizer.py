"""Rebuild a `tokenizers` fast tokenizer and a tokenizer_config from GGUF metadata.

Every LLM vocabulary llama.cpp's tests cover (its `models/ggml-vocab-*.gguf`, whose expected ids
were made by each model's own Hugging Face tokenizer):
- `gpt2`: byte-level BPE with llama.cpp's pre-tokenizers, chosen by `tokenizer.ggml.pre` (the
  splitting regexes of each model's tokenizer.json, applied in turn; `ignore_merges` where the
  model's BPE takes a word that is in the vocabulary whole);
- `llama`: SentencePiece BPE (Llama 2, Mistral 7B, Gemma 1/2, Phi-3): merges recovered from the
  pieces' scores as transformers' SentencePiece converter does, spaces as "▁", a leading "▁"
  unless `add_space_prefix` is false, and unknown characters as <0xXX> byte tokens;
- `gemma4`: BPE over "▁"-escaped UTF-8 with stored merges and byte fallback (Gemma 3n/4).
Anything else (BERT's WordPiece, T5's Unigram, RWKV) is refused with the file and the type named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors)

from brisk.errors import ModelLoadError

# llama.cpp's token types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's "▁"
_READERS = ("gpt2", "llama", "gemma4")  # the `tokenizer.ggml.model` types brisk rebuilds

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (code points escaped: an editor that normalizes text to NFC would turn some range ends into others)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_DEEPSEEK_V3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)
_BLOOM = (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]  # split in turn, each piece kept ("isolated"), then GPT-2's byte encoding
    ignore_merges: bool = False  # a piece that is itself a token is taken whole (Llama 3's BPE)


def _named(regexes: tuple[str, ...], *names: str, ignore_merges: bool = False) -> dict[str, PreTokenizer]:
    return {name: PreTokenizer(regexes, ignore_merges) for name in names}


# GGUF `tokenizer.ggml.pre` -> pre-tokenizer, as llama.cpp maps the names (llama-vocab.cpp)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_named(_DEFAULT, "default"),
    **_named((_LLAMA3,), "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
             ignore_merges=True),
    **_named((_LLAMA3,), "dbrx", "smaug-bpe", "chatglm-bpe"),
    **_named((_LLAMA3,), "glm4", "glm5", ignore_merges=True),
    **_named(_DEEPSEEK_LLM, "deepseek-llm"),
    **_named(_DEEPSEEK_CODER, "deepseek-coder"),
    **_named(_DEEPSEEK_V3, "deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
    **_named(_FALCON, "falcon"),
    **_named(_STARCODER, "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
    **_named((_GPT2,), "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-es",
             "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "exaone4",
             "jina-v1-en", "jina-v2-code", "roberta-bpe"),
    **_named((_QWEN2,), "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "solar-open",
             "megrez"),
    **_named((_QWEN35,), "qwen35"),
    **_named((_TEKKEN,), "tekken", ignore_merges=True),
    **_named((_GPT4O,), "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    **_named(_BLOOM, "poro-chat", "bloom", "gpt3-finnish"),
    **_named((_BLOOM[0], r"\p{N}"), "viking"),
}


def _byte_level(pre: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def check_vocabulary(meta: dict[str, Any], source: str) -> None:
    """Refuse, naming it, a tokenizer type or BPE pre-tokenizer brisk cannot rebuild (metadata only:
    the pre-flight check before anything is converted)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _READERS:
        what = {"bert": "BERT's WordPiece (an encoder model, not a generator)", "t5": "T5's Unigram",
                "rwkv": "RWKV's"}.get(kind, repr(kind))
        raise ModelLoadError(f"{source}: GGUF tokenizer type {kind!r} ({what}) is not supported; brisk reads "
                             f"{', '.join(_READERS)} vocabularies")
    if kind == "gpt2":
        pre_name = meta.get("tokenizer.ggml.pre") or "default"
        if pre_name not in PRE_TOKENIZERS:
            raise ModelLoadError(f"{source}: GGUF pre-tokenizer {pre_name!r} is not one brisk knows (it reads "
                                 f"{len(PRE_TOKENIZERS)} of llama.cpp's, e.g. llama-bpe, qwen2, tekken); use the "
                                 "model's Hugging Face directory instead")


def _bpe(meta: dict[str, Any], tokens: list[str], source: str) -> Tokenizer:
    pre = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre") or "default"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_merges(meta), fuse_unk=False,
                               byte_fallback=False, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = _byte_level(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]  # type: ignore[misc]


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The merges of a SentencePiece BPE vocabulary, which stores scores instead: every split of a
    piece into two pieces, the most probable merged piece first (transformers' converter)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED, _UNUSED)}
    ranked = []
    for piece, index in vocab.items():
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((scores[index], left, right) for left, right in local)
    ranked.sort(key=lambda merge: -merge[0])  # stable: ties keep the order above
    return [(left, right) for _, left, right in ranked]


def _spm(meta: dict[str, Any], tokens: list[str], types: list[int], source: str) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ModelLoadError(f"{source}: a SentencePiece GGUF vocabulary without tokenizer.ggml.scores; "
                             "the file is incomplete")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=spm_merges(tokens, list(scores), types),
                               unk_token=tokens[unk] if unk is not None else None, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _gemma4(meta: dict[str, Any], tokens: list[str], source: str) -> Tokenizer:
    """BPE over "▁"-escaped UTF-8 with stored merges, split at newlines only, bytes as <0xXX>."""
    if "tokenizer.ggml.merges" not in meta:
        raise ModelLoadError(f"{source}: a gemma4 GGUF vocabulary without tokenizer.ggml.merges; the file is "
                             "incomplete")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_merges(meta), fuse_unk=False,
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok



def build_tokenizer(meta: dict[str, Any], source: str) -> tuple[Tokenizer, dict[str, Any]]:
    """(fast tokenizer, tokenizer_config dict) from `tokenizer.*` GGUF metadata."""
    check_vocabulary(meta, source)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if kind == "gpt2":
        tok = _bpe(meta, tokens, source)
    elif kind == "llama":
        tok = _spm(meta, tokens, types, source)
    else:
        tok = _gemma4(meta, tokens, source)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, types) if kind_ == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind_ in zip(tokens, types) if kind_ == _USER_DEFINED])
    return tok, _tokenizer_config(meta, tokens, tok)


def _tokenizer_config(meta: dict[str, Any], tokens: list[str], tok: Tokenizer) -> dict[str, Any]:
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
    return {
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": add_bos,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
