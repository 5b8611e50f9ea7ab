"""The demo model in brisk vs HF transformers loading the same GGUF.

Both dequantize the GGUF to float32 here (`--quantization none`), so this checks the model
itself: greedy generations of 64 tokens must be identical token for token, and the
last-position logits of each prompt must agree within 1e-3 (fp32). The quantized formats
brisk serves by default are held to this float model in tests/test_quant.py.
"""

import pytest
import torch

from brisk.engine.sampling_params import SamplingParams
from brisk.models.simple_cache import SingleSequenceCache

from engines import make_engine

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


def _hf_eos_ids(hf_model) -> set[int]:
    eos = hf_model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def test_greedy_generations_match_hf_token_for_token(demo_fp32, hf_reference, prompt_ids):
    """Up to 64 tokens, stopping at EOS on both sides, as HF's greedy `generate` would produce them.
    Ours come from the paged engine (the server's path; float32 KV, all 20 prompts in one batch:
    greedy output does not depend on the batch, tests/test_engine_batching.py, which also holds the
    simple `generate_ids` path to the engine). HF checks each sequence in one forward pass: greedy
    decoding is HF's argmax at every position of prompt + generation, so each of our tokens must be
    HF's argmax after the tokens before it, none but the last may be one of HF's EOS tokens, and a
    sequence shorter than 64 must end in one. That is exactly the condition for
    `hf_model.generate(do_sample=False)` to return our tokens, at one forward per prompt instead of 64."""
    hf_model, _ = hf_reference
    hf_eos = _hf_eos_ids(hf_model)
    engine = make_engine(demo_fp32, kv_cache_dtype="float32")
    rids = [engine.add_request(ids, SamplingParams(max_tokens=64, temperature=0)) for ids in prompt_ids]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
    full_length = 0
    for prompt, ids, rid in zip(PROMPTS, prompt_ids, rids):
        ours = finished[rid]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1:]
        theirs = logits.argmax(-1).tolist()
        assert ours == theirs, f"generation differs for {prompt!r}: first at token {_first_difference(ours, theirs)}"
        assert not hf_eos & set(ours[:-1]), f"HF would have stopped earlier for {prompt!r}"
        assert len(ours) == 64 or ours[-1] in hf_eos, f"we stopped at a token HF does not stop at for {prompt!r}"
        full_length += len(ours) == 64
    assert full_length >= len(PROMPTS) // 2  # most comparisons run the whole 64 tokens


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
