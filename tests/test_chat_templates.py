"""The real chat templates of the families brisk serves (llama.cpp's `models/templates/`) render
exactly as transformers' `apply_chat_template(tokenize=False)` renders them: system prompts, several
turns, tools, assistant tool calls and tool results, reasoning, `add_generation_prompt` both ways,
and chat_template_kwargs such as Qwen3's `enable_thinking`. A conversation a template refuses
(its `raise_exception`) is refused by both."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as FastTokenizer, models

from brisk.tokenizer import ChatTemplateError, Tokenizer

from llamacpp import llamacpp_dir

TEMPLATES = [
    "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "mistralai-Mistral-Nemo-Instruct-2407", "microsoft-Phi-3.5-mini-instruct", "google-gemma-2-2b-it",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "HuggingFaceTB-SmolLM3-3B", "Mistral-Small-3.2-24B-Instruct-2506", "openai-gpt-oss-120b",
]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
CALL = {"id": "call9f3a2b1c4", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello! 你好 🙂"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "turns": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "One"},
              {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}],
    "tool_call": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call9f3a2b1c4", "name": "get_weather",
                   "content": json.dumps({"temp": 21})}],
    "reasoning": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
                  {"role": "user", "content": "And 3+3?"}],
}


def template_source(name: str) -> str:
    return (llamacpp_dir() / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def word_tokenizer() -> FastTokenizer:
    return FastTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}, unk_token="<unk>"))


def hf_render(source: str, fast: FastTokenizer, messages, tools, add_generation_prompt: bool, **kwargs):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=fast, chat_template=source, **SPECIALS)
    try:
        return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - the template's own refusal (raise_exception) or a failure
        return ("refused", type(e).__name__)


def brisk_render(source: str, fast: FastTokenizer, messages, tools, add_generation_prompt: bool, **kwargs):
    tok = Tokenizer(fast, {**SPECIALS, "chat_template": source})
    try:
        return tok.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
    except ChatTemplateError:
        return ("refused", "TemplateError")


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_renders_as_transformers_does(name, word_tokenizer):
    source = template_source(name)
    rendered = refused = 0
    for label, messages in CONVERSATIONS.items():
        for tools in (None, [WEATHER]):
            for gen in (True, False):
                expected = hf_render(source, word_tokenizer, messages, tools, gen)
                got = brisk_render(source, word_tokenizer, messages, tools, gen)
                if isinstance(expected, tuple):
                    assert isinstance(got, tuple), f"{label}, tools={bool(tools)}: transformers refused {expected}"
                    refused += 1
                else:
                    assert got == expected, f"{label}, tools={bool(tools)}, add_generation_prompt={gen}"
                    rendered += 1
    assert rendered >= 8, f"only {rendered} conversations rendered ({refused} refused)"


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_gpt_oss_reasoning_effort_renders_as_transformers_does(word_tokenizer, effort):
    """gpt-oss's template writes `Reasoning: <effort>` into its system message from the reasoning_effort kwarg
    (what chat's reasoning_effort and the Responses API's reasoning.effort reach)."""
    source = template_source("openai-gpt-oss-120b")
    messages = CONVERSATIONS["system"]
    expected = hf_render(source, word_tokenizer, messages, [WEATHER], True, reasoning_effort=effort)
    assert f"Reasoning: {effort}" in expected
    assert brisk_render(source, word_tokenizer, messages, [WEATHER], True, reasoning_effort=effort) == expected


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_enable_thinking_is_a_template_kwarg(word_tokenizer, enable_thinking):
    source = template_source("Qwen-Qwen3-0.6B")
    messages = CONVERSATIONS["user"]
    got = brisk_render(source, word_tokenizer, messages, None, True, enable_thinking=enable_thinking)
    assert got == hf_render(source, word_tokenizer, messages, None, True, enable_thinking=enable_thinking)
    assert ("<think>\n\n</think>" in got) != enable_thinking
