"""The grammar's token mask and its consume step agree on every token of the vocabulary, added tokens
included (issue 61): with a tokenizer whose `<think>` and `</think>` are added, non-special tokens (as in
Qwen3), llguidance used to let `<think>` through the mask where a grammar forces the text "<think>" and
then reject it, so a constrained reply ended after one token with nothing in it."""

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
from brisk.structured.vocabulary import text_added_tokens

THINKING = r"<think>[a-z ]{3,30}</think>[A-Za-z ]{3,30}"
VOCAB = 49160  # the demo vocabulary (49152), the two added tokens, and padding ids past the tokenizer


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


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.value[:24])
def test_every_token_the_mask_allows_is_consumed(compiler, spec):
    """Along sampled walks through the grammar, at each state every token the mask allows is accepted by the
    consume step (each tried on its own copy of the matcher), none of the special tokens is allowed while
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
            rejected = [t for t in allowed if not matcher.deep_copy().consume_token(t)]
            assert not rejected, (walk, step, rejected[:10])
            if not matcher.is_accepting():
                assert not set(allowed) & set(range(17)), (walk, step)  # <|endoftext|> ... <empty_output>
            token = rng.choice(allowed)
            assert matcher.consume_token(token)
        if spec.kind != "json":  # (a random walk may spend its 64 steps in JSON's optional whitespace)
            assert matcher.is_stopped() or matcher.is_accepting(), walk


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
