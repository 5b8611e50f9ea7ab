"""Tokenizer: `tokenizers` fast tokenizer, jinja2 chat templates with HF semantics,
and an incremental detokenizer that never emits broken UTF-8."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.decoders import DecodeStream

from brisk.errors import BriskError, ModelLoadError


class ChatTemplateError(BriskError):
    """The chat template rejected the messages (its `raise_exception`) or failed to render."""


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant tokens for training
    masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _template_dict(*args, **kwargs) -> dict:
    return dict(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace without underscore-prefixed attributes (as transformers restricts it)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile as transformers does: sandboxed, trim_blocks/lstrip_blocks, loop controls, its
    `generation` tag, `raise_exception`, `strftime_now`, `tojson` (no HTML escaping), `dict`, `namespace`."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _template_dict
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


# transformers fills `reasoning_content` (and gpt-oss's `thinking`) from the older names of a message's reasoning
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# the special tokens transformers passes to every template, by tokenizer_config.json's names
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _aliased_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


@functools.lru_cache(maxsize=8)
def _template_variables(source: str) -> frozenset[str]:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


class Tokenizer:
    def __init__(self, fast: FastTokenizer, config: dict[str, Any], eos_token_ids: tuple[int, ...] = ()):
        self.fast = fast
        self.config = config
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.special_tokens = {k: _token_str(config[k]) for k in _SPECIAL_TOKENS if config.get(k) is not None}
        self.bos_token_id = fast.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = list(eos_token_ids)
        if self.eos_token and fast.token_to_id(self.eos_token) is not None:
            eos_ids.insert(0, fast.token_to_id(self.eos_token))
        self.eos_token_ids = tuple(dict.fromkeys(eos_ids))
        template = config.get("chat_template")
        if isinstance(template, list):  # HF allows a list of named templates
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template_source: str | None = template
        self._chat_template = compile_chat_template(template) if template else None

    @classmethod
    def from_dir(cls, model_dir: Path, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json; brisk needs a fast tokenizer file")
        try:
            fast = FastTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise ModelLoadError(f"{path}: unreadable tokenizer ({e}); re-download it") from None
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{config_path}: malformed JSON ({e})") from None
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.is_file():
            config["chat_template"] = jinja_path.read_text(encoding="utf-8")
        return cls(fast, config, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    def set_chat_template(self, source: str) -> None:
        """Use `source` instead of the model's own template (`brisk serve --chat-template`)."""
        self.chat_template_source = source
        self._chat_template = compile_chat_template(source)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: measured, `encode` kept the GIL for the whole call when run from a
        # thread pool (a 900k-character prompt stalled the server's event loop 1.4 s), `encode_batch`
        # releases it while it works (stalls <= 60 ms), with the same ids.
        return self.fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render as transformers' apply_chat_template(tokenize=False) does: the messages (reasoning under
        all its names), `tools` and `documents` (None when absent), the special tokens, and `kwargs`
        (a request's chat_template_kwargs, e.g. enable_thinking)."""
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        try:
            return self._chat_template.render(**{
                "bos_token": "", "eos_token": "", **self.special_tokens, **kwargs,
                "messages": _aliased_reasoning(messages), "tools": tools or None, "documents": None,
                "add_generation_prompt": add_generation_prompt})
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - a template is code: whatever it raises is its failure on these messages
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered template; the template itself places any BOS (HF semantics)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    @property
    def template_variables(self) -> set[str]:
        """The variables the chat template reads (`tools` among them if it renders tool definitions)."""
        return _template_variables(self.chat_template_source) if self.chat_template_source else set()

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (byte-level BPE pieces may be partial UTF-8)."""
        piece = self.fast.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.fast.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    stand_ins = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            stand_ins.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, stand_ins)}


class IncrementalDetokenizer:
    """Turns token ids into text one token at a time.

    A token may end in the middle of a multi-byte character (CJK, emoji); such bytes
    are held back until the character is complete, so every emitted piece is valid
    UTF-8 and the concatenation equals `decode(all_ids)`.

    tokenizers' DecodeStream raises when a prefix decodes differently once more ids follow, which
    byte-fallback tokens (SentencePiece vocabularies: Llama 2, Mistral, Gemma) do when their bytes
    are not valid UTF-8: a sampled reply must not end the engine for that. From the first such
    token on, text comes from decoding a window of ids (the prefix/read offsets vLLM uses) and
    emitting what it adds, holding back a trailing replacement character.
    """

    _WINDOW = 6  # ids decoded before the new ones, so a piece's leading space and bytes come out right

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._prefix_offset = self._read_offset = 0
        self.text = ""

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._tokenizer.fast, token_id) or ""
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception for an inconsistent prefix
                self._stream = None
                self._read_offset = len(self._ids) - 1
                self._prefix_offset = max(self._read_offset - self._WINDOW, 0)
            else:
                self.text += piece
                return piece
        return self._offset_step()

    def _offset_step(self) -> str:
        def decode(ids: list[int]) -> str:
            return self._tokenizer.fast.decode(ids, skip_special_tokens=self._skip_special_tokens)

        before = decode(self._ids[self._prefix_offset:self._read_offset])
        after = decode(self._ids[self._prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete character: wait for the next id
        piece = after[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += piece
        return piece
