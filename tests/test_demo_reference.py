"""The demo model in brisk vs HF transformers loading the same GGUF.

Both dequantize the GGUF to float32 here (`--quantization none`), so this checks the model
itself: greedy generations of 64 tokens must be identical token for token, and the
last-position logits of each prompt must agree within 1e-3 (fp32). The quantized formats
brisk serves by default are held to this float model in tests/test_quant.py.
"""

import pytest
import torch

from brisk.generate import generate_ids
from brisk.models.simple_cache import SingleSequenceCache

pytestmark = pytest.mark.slow  # the HF transformers reference, token for token: `pytest -m 'not slow'` skips it locally

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "List three tips for writing clean Python code.",
    "def fibonacci(n):\n    # complete this function\n",
    "What does `git rebase -i HEAD~3` do?",
    "Translate to French: The weather is lovely today.",
    "你好，请用中文介绍一下长城。",
    "为什么天空是蓝色的？",
    "日本の首都はどこですか？",
    "おすすめの本を一冊教えてください。",
    "I love pizza 🍕 and tacos 🌮 — what should I cook tonight? 😀",
    "Summarize: The quick brown fox jumps over the lazy dog. 1234567890",
    "SELECT name, COUNT(*) FROM users GROUP BY name; -- what does this query return?",
    "Give me a JSON object with keys name and age.",
    "What is 17 * 23?",
    "Write a short story opening in one sentence.",
    "Was ist der Unterschied zwischen 'seit' und 'seid'?",
    "Mixed: 数据库 database データベース 🚀 — which word is Japanese?",
    "How do I reverse a list in Rust? fn main() { let v = vec![1, 2, 3]; }",
]


def _hf_prompt_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def prompt_ids(demo_fp32, hf_reference):
    _, hf_tok = hf_reference
    out = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = demo_fp32.tokenizer.encode_chat(messages)
        assert ids == _hf_prompt_ids(hf_tok, messages), f"tokenization differs from HF for {prompt!r}"
        out.append(ids)
    return out


def test_last_position_logits_match_hf(demo_fp32, hf_reference, prompt_ids):
    demo = demo_fp32
    hf_model, _ = hf_reference
    worst = 0.0
    for ids in prompt_ids:
        cache = SingleSequenceCache(demo.config, len(ids), torch.float32, "cpu")
        cache.begin(len(ids))
        with torch.inference_mode():
            ours = demo.model.compute_logits(demo.model(torch.tensor(ids), torch.arange(len(ids)), cache)[-1:])[0]
            ref = hf_model(torch.tensor([ids])).logits[0, -1]
        worst = max(worst, float((ours - ref).abs().max()))
    assert worst <= 1e-3


def test_greedy_generations_match_hf_token_for_token(demo_fp32, hf_reference, prompt_ids):
    demo = demo_fp32
    """Up to 64 tokens, stopping at EOS on both sides (HF's generate always stops there)."""
    hf_model, _ = hf_reference
    full_length = 0
    for prompt, ids in zip(PROMPTS, prompt_ids):
        ours = list(generate_ids(demo, ids, max_tokens=64))
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=64, do_sample=False,
                                    pad_token_id=demo.tokenizer.eos_token_ids[0])
        theirs = out[0, len(ids):].tolist()
        assert ours == theirs, f"generation differs for {prompt!r}"
        full_length += len(ours) == 64
    assert full_length >= len(PROMPTS) // 2  # most comparisons run the whole 64 tokens
