"""Reasoning models: `--reasoning-parser` puts `<think>...</think>` into `reasoning_content`, streamed
and whole alike (vLLM's qwen3 and deepseek_r1 behaviour), and `chat_template_kwargs` reach the
template (Qwen3's enable_thinking)."""

import copy
import dataclasses

import pytest

from brisk.server.reasoning import ReasoningSplitter

from live_server import serve_engine
from llamacpp import llamacpp_dir
from engines import make_engine

MODEL = "smollm2-135m-instruct"


def split(parser: str, text: str, size: int) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser)
    reasoning = answer = ""
    for i in range(0, len(text), size):
        r, a = splitter.feed(text[i:i + size])
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nThe answer is 4.", ("\nLet me see.\n", "The answer is 4.")),
    ("qwen3", "The answer is 4.", ("", "The answer is 4.")),  # thinking off: no block at all
    ("qwen3", "<think>never closed", ("never closed", "")),
    ("qwen3", "  <thin", ("", "  <thin")),
    ("deepseek_r1", "Let me see.\n</think>\n\n4.", ("Let me see.\n", "4.")),  # the prompt opened <think>
    ("deepseek_r1", "<think>Let me see.</think>4.", ("Let me see.", "4.")),
    ("deepseek_r1", "all reasoning, cut", ("all reasoning, cut", "")),
])
def test_reasoning_split_is_the_same_at_any_split(parser, text, expected):
    for size in (1, 2, 5, len(text) or 1):
        assert split(parser, text, size) == expected


@pytest.fixture(scope="module")
def qwen3_server(demo):
    """The demo model behind Qwen3's real template, with --reasoning-parser qwen3."""
    source = (llamacpp_dir() / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    tokenizer = copy.copy(demo.tokenizer)
    tokenizer.set_chat_template(source)
    with serve_engine(make_engine(dataclasses.replace(demo, tokenizer=tokenizer)), reasoning_parser="qwen3") as live:
        yield live


THINKING = r"<think>[a-z ]{3,30}</think>[A-Za-z ]{3,30}"


def test_reasoning_content_stream_and_whole_agree(qwen3_server):
    """The demo model does not think; a regex makes it write a thinking block, so the server's path
    from tokens to reasoning_content is what is checked."""
    client = qwen3_server.openai()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], temperature=0, max_tokens=60,
              extra_body={"guided_regex": THINKING})
    whole = client.chat.completions.create(**kw).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and whole.content and "<think>" not in whole.content and "</think>" not in reasoning
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed["content"] += c.delta.content or ""
            streamed["reasoning_content"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": whole.content}


def test_enable_thinking_false_reaches_the_template(qwen3_server):
    with qwen3_server.client() as http:
        counts = {}
        for flag in (True, False):
            r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                             "chat_template_kwargs": {"enable_thinking": flag}})
            assert r.status_code == 200, r.text
            counts[flag] = r.json()["count"]
            chat = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                "chat_template_kwargs": {"enable_thinking": flag}})
            assert chat.json()["usage"]["prompt_tokens"] == counts[flag]
    assert counts[False] > counts[True]  # the template closed an empty <think></think> block
