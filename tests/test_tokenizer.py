"""Tokenizer from GGUF metadata vs HF's, chat templates with HF semantics, and the
incremental detokenizer on text that splits multi-byte characters across tokens."""

import pytest

from brisk.tokenizer import ChatTemplateError, Tokenizer, compile_chat_template
from tokenizers import Tokenizer as FastTokenizer, models

TEXTS = [
    "Hello, world! 12345 numbers split into digits",
    "你好，世界。长城很长。",
    "日本語のテキストとカタカナ",
    "emoji 😀🍕🚀👩‍💻 and flags 🇫🇷",
    "def f(x):\n\treturn x ** 2  # code\n\n",
    "  leading spaces and trailing   ",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_hf(demo, hf_reference, text):
    _, hf_tok = hf_reference
    assert demo.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=True)
    ids = demo.tokenizer.encode(text)
    assert demo.tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_never_emits_broken_utf8(demo, text):
    ids = demo.tokenizer.encode(text)
    detok = demo.tokenizer.detokenizer(skip_special_tokens=False)
    pieces = [detok.step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == demo.tokenizer.decode(ids, skip_special_tokens=False)


def test_multibyte_characters_are_split_across_tokens(demo):
    """The detokenizer test above only means something if some token holds a partial character."""
    ids = demo.tokenizer.encode("😀🍕🚀")
    partial = [i for i in ids if "\ufffd" in demo.tokenizer.decode([i])]
    assert partial


def test_chat_template_matches_hf(demo, hf_reference):
    _, hf_tok = hf_reference
    for messages in (
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"},
         {"role": "assistant", "content": "你好！"}, {"role": "user", "content": "再见"}],
    ):
        for add in (True, False):
            expected = hf_tok.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
            assert demo.tokenizer.apply_chat_template(messages, add_generation_prompt=add) == expected


def _tokenizer_with_template(template: str, bos="<s>", eos="</s>") -> Tokenizer:
    fast = FastTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "x": 2}, unk_token="x"))
    return Tokenizer(fast, {"chat_template": template, "bos_token": bos, "eos_token": {"content": eos}})


def test_template_semantics_bos_eos_generation_prompt_tojson():
    tok = _tokenizer_with_template(
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}={{ m['content'] | tojson }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant={% endif %}")
    text = tok.apply_chat_template([{"role": "user", "content": "é\"q"}], add_generation_prompt=True)
    assert text == '<s>user="é\\"q"</s>\nassistant='
    assert tok.eos_token_ids == (1,) and tok.bos_token_id == 0


def test_template_raise_exception_is_a_clear_error():
    tok = _tokenizer_with_template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_is_sandboxed():
    import jinja2.exceptions

    template = compile_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        template.render(messages=[])


def test_missing_template_is_a_clear_error():
    fast = FastTokenizer(models.WordLevel({"x": 0}, unk_token="x"))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(fast, {}).apply_chat_template([{"role": "user", "content": "x"}])


def test_byte_fallback_bytes_that_are_not_utf8_do_not_break_the_detokenizer():
    """A SentencePiece vocabulary's byte tokens (<0x..>) in an order that is not valid UTF-8: the
    tokenizers DecodeStream raises on the third id here ("Invalid prefix encountered"), which ended
    the whole engine loop when a Gemma 2 GGUF sampled such a reply. The detokenizer goes on and never
    emits a half character. (A full decode turns a valid byte that an invalid one follows into
    U+FFFD too; a stream that already sent that byte cannot take it back, so only the rest agrees.)"""
    from tokenizers.decoders import DecodeStream

    from brisk.loading.gguf_header import GGUFFile
    from brisk.loading.gguf_tokenizer import build_tokenizer
    from brisk.tokenizer import Tokenizer
    from llamacpp import llamacpp_dir

    path = llamacpp_dir() / "models" / "ggml-vocab-llama-spm.gguf"
    fast, config = build_tokenizer(GGUFFile(path).metadata, str(path))
    ids = [17, 228, 15774, 26144, 36, 241, 210, 9027, 7796, 67, 1302, 41]
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):  # what the library does: the case is real
        for token in ids:
            stream.step(fast, token)
    detok = Tokenizer(fast, config, ()).detokenizer()
    pieces = [detok.step(token) for token in ids]
    assert all(p.encode("utf-8").decode("utf-8") == p for p in pieces)
    assert "".join(pieces) == detok.text
    whole = fast.decode(ids, skip_special_tokens=True)
    assert " fruit зу" in whole and " fruit зу" in detok.text
    assert whole.endswith(" densityldots@ co&") and detok.text.endswith(" densityldots@ co&")
