"""The grammar's token mask and its consume step agree on every token of the vocabulary, added tokens
included (issue 61): with a tokenizer whose `<think>` and `</think>` are added, non-special tokens (as in
Qwen3), llguidance used to let `<think>` through the mask where a grammar forces the text "<think>" and
then reject it, so a constrained reply ended after one token with nothing in it. And with a vocabulary
that cannot write every byte (the demo's has no token for 0xF1), a grammar forcing such a character was
fast-forwarded to a wrong token, which the grammar then rejected (a 500 from the grammar fuzzer): now the
mask stops before that character and the request ends as `grammar_unsatisfiable`."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from tokenizers import AddedToken, Tokenizer

from brisk.engine.sampling_params import SamplingParams
from brisk.structured.bitmask import allowed_tokens
from brisk.structured.compiler import GrammarCompiler
from brisk.structured.spec import GrammarSpec, choice_spec, json_spec
from brisk.structured.vocabulary import UTF8_BYTES, byte_tokens, text_added_tokens

THINKING = r"<think>[a-z ]{3,30}</think>[A-Za-z ]{3,30}"
VOCAB = 49160  # the demo vocabulary (49152), the two added tokens, and padding ids past the tokenizer
UNWRITABLE = "\U00040000"  # UTF-8 F1 80 80 80: no token of the demo vocabulary is the byte 0xF1


@pytest.fixture(scope="module")
def thinking_tokenizer(demo) -> Tokenizer:
    fast = Tokenizer.from_str(demo.tokenizer.fast.to_str())
    fast.add_tokens([AddedToken("<think>", special=False, normalized=False),
                     AddedToken("</think>", special=False, normalized=False)])
    assert fast.token_to_id("<think>") == 49152 and fast.token_to_id("</think>") == 49153
    return fast


@pytest.fixture(scope="module")
def compiler(thinking_tokenizer, demo):
    compiler = GrammarCompiler(thinking_tokenizer, VOCAB, demo.tokenizer.eos_token_ids)
    yield compiler
    compiler.close()


SPECS = [GrammarSpec("regex", THINKING, "guided_regex"),
         choice_spec(["<think>yes</think>ok", "<think>no</think>", "plain"], "guided_choice"),
         GrammarSpec("regex", r"(<think>a|<think>b)c", "guided_regex"),
         json_spec({"type": "object", "properties": {"t": {"type": "string", "maxLength": 12}},
                    "required": ["t"]}, "guided_json")]


def test_added_tokens_that_are_not_special_are_text(thinking_tokenizer, demo):
    assert text_added_tokens(thinking_tokenizer) == {49152, 49153}
    assert text_added_tokens(demo.tokenizer.fast) == set()  # the demo's added tokens are all special


CHECKED = 512  # allowed tokens tried per state: all of them where the grammar allows fewer (forced text)


def checked(allowed: list[int], rng: random.Random) -> list[int]:
    """Every allowed token where the mask allows at most CHECKED (a forced state, where the fast-forward
    picks the token), else CHECKED of them drawn at random: inside a JSON string or free text the mask
    allows tens of thousands, and trying each made this test ~40 s."""
    return allowed if len(allowed) <= CHECKED else rng.sample(allowed, CHECKED)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.value[:24])
def test_every_token_the_mask_allows_is_consumed(compiler, spec):
    """Along sampled walks through the grammar, at each state every token the mask allows (CHECKED of them
    where it allows more) is accepted by the consume step (each tried on its own copy of the matcher), none of the special tokens is allowed while
    the grammar needs more text, and the walk reaches the grammar's end. (The other way round need not
    hold: where the grammar forces text, llguidance allows its canonical tokens only, "<think>" and not
    "<" then "think>", though consume would take either.)"""
    rng = random.Random(0)
    for walk in range(3):
        matcher = compiler.compile(spec).matcher()
        for step in range(64):
            if matcher.is_stopped():
                break
            allowed = torch.nonzero(allowed_tokens(matcher, VOCAB)).flatten().tolist()
            assert allowed, (walk, step)
            rejected = [t for t in checked(allowed, rng) if not matcher.deep_copy().consume_token(t)]
            assert not rejected, (walk, step, rejected[:10])
            if not matcher.is_accepting():
                assert not set(allowed) & set(range(17)), (walk, step)  # <|endoftext|> ... <empty_output>
            token = rng.choice(allowed)
            assert matcher.consume_token(token)
        if spec.kind != "json":  # (a random walk may spend its 64 steps in JSON's optional whitespace)
            assert matcher.is_stopped() or matcher.is_accepting(), walk


def test_the_demo_vocabulary_cannot_write_every_byte(demo):
    """The premise of the tests below: some bytes UTF-8 uses have no token, and `tokenizers` drops a
    character made of them without a word."""
    import llguidance

    fast = demo.tokenizer.fast
    base = llguidance.LLTokenizer(fast.to_str(), n_vocab=demo.config.vocab_size, eos_token=[2])
    assert 0xF1 in UTF8_BYTES - byte_tokens(base, demo.config.vocab_size).keys()
    assert fast.decode(fast.encode(f"a{UNWRITABLE}b", add_special_tokens=False).ids) != f"a{UNWRITABLE}b"


@pytest.fixture(scope="module")
def demo_compiler(demo):
    compiler = GrammarCompiler(demo.tokenizer.fast, demo.config.vocab_size, demo.tokenizer.eos_token_ids)
    yield compiler
    compiler.close()


def test_a_grammar_that_starts_with_text_the_vocabulary_cannot_write_is_refused(demo_compiler):
    """Caught before the request runs (a 400 naming the field): its first mask allows no token."""
    from brisk.structured.limits import GrammarError

    with pytest.raises(GrammarError, match="guided_choice: matches no text this model can write .*vocabulary"):
        demo_compiler.compile(choice_spec([UNWRITABLE, f"{UNWRITABLE}x"], "guided_choice"))


@pytest.mark.parametrize("spec, alternatives", [
    (GrammarSpec("regex", f"(ab|cd){UNWRITABLE}e", "guided_regex"), ["ab", "cd"]),
    (choice_spec([f"héllo {UNWRITABLE}", "wörld"], "guided_choice"), ["héllo ", "wörld"]),
    (choice_spec(["héllo wörld ñ±ü", "x"], "guided_choice"), None)], ids=["regex", "choice", "writable"])
def test_text_the_vocabulary_cannot_write_leaves_the_mask_empty(demo_compiler, demo, spec, alternatives):
    """A grammar whose every way on needs a character the vocabulary cannot write: at every step each
    token the mask allows is consumed (before the fix, the fast-forward allowed the token for 0x80 where
    0xF1 was due), and once the character is forced no token is allowed (the matcher is in error: the
    engine's `grammar_unsatisfiable`), before any of it is written. Text it can write is written whole."""
    vocab = demo.config.vocab_size
    matcher = demo_compiler.compile(spec).matcher()
    written = []
    for _ in range(32):
        allowed = torch.nonzero(allowed_tokens(matcher, vocab)).flatten().tolist()
        if matcher.is_error() or matcher.is_stopped():
            break
        assert allowed and not [t for t in allowed if not matcher.deep_copy().consume_token(t)], allowed[:10]
        assert matcher.consume_token(allowed[0])
        written.append(allowed[0])
    decoded = demo.tokenizer.decode(written)
    if alternatives is None:
        assert decoded == json.loads(spec.value)[0] and matcher.is_stopped() and not matcher.is_error()
    else:
        assert written and matcher.is_error(), (decoded, matcher.get_error())
        assert any(alt.startswith(decoded) for alt in alternatives), decoded


def test_a_forced_think_takes_the_added_token(compiler):
    """Where the grammar forces "<think>", the mask allows the added token that is that text (what the
    model would write), and consuming it moves the grammar on."""
    matcher = compiler.compile(SPECS[0]).matcher()
    allowed = torch.nonzero(allowed_tokens(matcher, VOCAB)).flatten().tolist()
    assert 49152 in allowed
    assert matcher.consume_token(49152) and not matcher.is_error()


@pytest.fixture(scope="module")
def thinking_llm(tmp_path_factory, thinking_tokenizer, demo, brisk_cache):
    """A tiny random Llama over that vocabulary (transformers writes it; brisk serves it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from brisk.llm import LLM

    path = tmp_path_factory.mktemp("thinking") / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 eos_token_id=2, bos_token_id=1)).save_pretrained(path)
    thinking_tokenizer.save(str(path / "tokenizer.json"))
    shutil.copy(demo.model_dir / "tokenizer_config.json", path / "tokenizer_config.json")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {**config.get("added_tokens_decoder", {}), **{
        str(i): {"content": t, "special": False, "normalized": False, "lstrip": False, "rstrip": False,
                 "single_word": False} for i, t in ((49152, "<think>"), (49153, "</think>"))}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return LLM(str(path), max_model_len=256, num_blocks=128)


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: s.value[:24])
def test_a_constrained_reply_writes_the_added_token_and_finishes(thinking_llm, spec):
    """The engine's end of it: the reply matches the grammar, with `<think>` written as its added token,
    and ends as a normal reply (before the fix: one token, finish "stop", no text)."""
    import re

    params = SamplingParams(temperature=0, max_tokens=60, grammar=thinking_llm.grammars.compile(spec),
                            skip_special_tokens=False)
    out = thinking_llm.generate("Think first.", params)[0]
    assert out.error is None and out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
    pattern = spec.value if spec.kind == "regex" else "|".join(re.escape(c) for c in json.loads(spec.value))
    assert re.fullmatch(pattern, out.text), out.text
    if spec.kind == "regex":  # these force "<think>" first: its added token is the canonical way to write it
        assert out.token_ids[0] == 49152


def test_a_grammar_the_vocabulary_cannot_write_ends_the_request_with_that_reason(thinking_llm):
    """The engine's end: the request fails as grammar_unsatisfiable naming its field, not with a token the
    grammar rejects nor a reply that looks complete."""
    params = SamplingParams(temperature=0, max_tokens=20, grammar=thinking_llm.grammars.compile(
        GrammarSpec("regex", f"(ok|no) {UNWRITABLE}", "guided_regex")))
    out = thinking_llm.generate("Go.", params)[0]
    assert out.finish_reason == "error" and out.error[0] == "grammar_unsatisfiable", (out.error, out.text)
    assert out.error[2] == "guided_regex" and "cannot be met" in out.error[1]
