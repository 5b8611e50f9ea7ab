"""The context guard: exact unit behaviour per policy, and e2e at the window's edge with
Chinese and mixed-script prompts counted by the model's own tokenizer."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from brisk.config import CacheConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.scheduler import SchedulerConfig
from brisk.server.context_guard import ContextLengthError, ContextPolicy, guard_chat, guard_prompt

from live_server import serve_engine

WINDOW = 256


# -- unit: a fake tokenizer where each message costs 2 + len(content) tokens ------------
def fake_encode(messages):
    return [0] * sum(2 + len(m["content"]) for m in messages)


def conversation(*sizes):
    """A system message, then alternating user/assistant turns with contents of these sizes."""
    msgs = [{"role": "system", "content": "s" * 8}]
    for i, size in enumerate(sizes):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": "x" * size})
    return msgs


def test_reject_reports_tokens_and_window():
    with pytest.raises(ContextLengthError) as err:
        guard_prompt([0] * 90, 20, 100, ContextPolicy.REJECT)
    e = err.value
    assert (e.prompt_tokens, e.max_tokens, e.max_model_len, e.param) == (90, 20, 100, "max_tokens")
    assert "110 tokens (90 in the prompt, 20 for the completion)" in str(e) and "100 tokens" in str(e)


@pytest.mark.parametrize("policy", list(ContextPolicy))
def test_exact_fit_passes_untouched(policy):
    result = guard_prompt([0] * 80, 20, 100, policy)
    assert (result.outcome, result.max_tokens, result.truncated_messages) == ("ok", 20, 0)


def test_prompt_filling_the_window_is_rejected_even_with_clamp():
    with pytest.raises(ContextLengthError) as err:
        guard_prompt([0] * 100, 5, 100, ContextPolicy.CLAMP_MAX_TOKENS)
    assert err.value.param == "prompt"


def test_clamp_lowers_max_tokens_to_what_fits():
    result = guard_prompt([0] * 90, 50, 100, ContextPolicy.CLAMP_MAX_TOKENS)
    assert (result.outcome, result.max_tokens, result.max_tokens_clamped_to) == ("clamped", 10, 10)
    assert result.report() == {"context_policy": "clamp-max-tokens", "context_outcome": "clamped",
                               "prompt_tokens": 90, "max_tokens_clamped_to": 10}
    assert result.headers()["x-brisk-max-tokens-clamped-to"] == "10"


def test_default_max_tokens_takes_the_rest_of_the_window():
    assert guard_prompt([0] * 99, None, 100, ContextPolicy.REJECT).max_tokens == 1
    with pytest.raises(ContextLengthError):
        guard_prompt([0] * 100, None, 100, ContextPolicy.REJECT)


def test_truncate_oldest_drops_the_fewest_oldest_messages():
    msgs = conversation(30, 30, 30, 30, 10)  # 10 + 4*32 + 12 = 150 tokens
    result = guard_chat(msgs, fake_encode, 20, 100, ContextPolicy.TRUNCATE_OLDEST)
    # room for 80 prompt tokens: dropping 2 leaves 10 + 32 + 32 + 12 = 86 (too many), 3 leaves 54
    assert result.outcome == "truncated" and result.truncated_messages == 3
    assert result.messages == [msgs[0], msgs[4], msgs[5]]
    assert result.prompt_tokens == 54 and result.max_tokens == 20


def test_truncate_oldest_keeps_system_and_last_user_or_rejects():
    msgs = conversation(30, 30, 95)
    with pytest.raises(ContextLengthError) as err:
        guard_chat(msgs, fake_encode, 10, 100, ContextPolicy.TRUNCATE_OLDEST)
    assert "keeping only the system message(s) and the last user message" in str(err.value)
    assert err.value.prompt_tokens == 10 + 97


def test_truncate_oldest_leaves_fitting_chats_alone():
    msgs = conversation(10, 10)
    result = guard_chat(msgs, fake_encode, 10, 100, ContextPolicy.TRUNCATE_OLDEST)
    assert result.outcome == "ok" and result.messages == msgs


# -- e2e at the boundary, real tokenizer ----------------------------------------------------
def small_window_engine(demo):
    return LLMEngine(demo, CacheConfig(block_size=16, num_gpu_blocks_override=96),
                     SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=WINDOW))


@pytest.fixture(scope="module", params=[p.value for p in ContextPolicy])
def policy_server(request, demo):
    with serve_engine(small_window_engine(demo), context_policy=ContextPolicy(request.param)) as live:
        yield request.param, live


TEXTS = {
    "chinese": "请用中文解释一下为什么大语言模型的第一个请求比后面的请求慢。" * 3,
    "mixed": "Explain KV缓存 fragmentation — 断片化とは? 🙂 Ünïcödé mix " * 2,
}


def chat_with_tokens(tokenizer, text: str, target: int) -> list[dict]:
    """A one-message chat whose templated prompt has exactly `target` tokens (bounded search)."""
    for pad in range(0, 400):
        msgs = [{"role": "user", "content": text + " x" * pad}]
        n = len(tokenizer.encode_chat(msgs))
        if n == target:
            return msgs
        if n > target:
            break
    raise AssertionError(f"could not build a {target}-token prompt")


@pytest.mark.parametrize("script", list(TEXTS))
@pytest.mark.parametrize("excess", [-1, 0, 1])
def test_boundary_prompt_plus_max_tokens(demo, policy_server, script, excess):
    policy, live = policy_server
    prompt_tokens = 200
    msgs = chat_with_tokens(demo.tokenizer, TEXTS[script], prompt_tokens)
    max_tokens = WINDOW - prompt_tokens + excess
    with live.client() as http:
        counted = http.post("/tokenize", json={"messages": msgs}).json()["count"]
        assert counted == prompt_tokens  # the server counts after the template, like the engine
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                                                     "ignore_eos": True})
    if excess <= 0:
        assert r.status_code == 200
        body = r.json()
        assert body["brisk"]["context_outcome"] == "ok" and body["usage"]["prompt_tokens"] == prompt_tokens
        assert body["usage"]["completion_tokens"] == max_tokens
    elif policy == "clamp-max-tokens":
        assert r.status_code == 200
        body = r.json()
        assert body["brisk"]["max_tokens_clamped_to"] == WINDOW - prompt_tokens
        assert r.headers["x-brisk-context-outcome"] == "clamped"
        assert r.headers["x-brisk-max-tokens-clamped-to"] == str(WINDOW - prompt_tokens)
        assert body["usage"]["completion_tokens"] == WINDOW - prompt_tokens
    else:  # reject, and truncate-oldest with nothing to drop
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
        assert err["param"] in ("max_tokens", "messages")
        assert f"{WINDOW} tokens" in err["message"] and f"{prompt_tokens} in the prompt" in err["message"]


@pytest.mark.parametrize("excess", [-1, 0, 1])
def test_boundary_prompt_alone(demo, policy_server, excess):
    """No max_tokens: the prompt must leave room for one token."""
    _, live = policy_server
    msgs = chat_with_tokens(demo.tokenizer, TEXTS["chinese"], WINDOW + excess)
    with live.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "ignore_eos": True})
    if excess < 0:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
        assert r.json()["choices"][0]["finish_reason"] == "length"
    else:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_truncate_oldest_e2e_reports_what_it_dropped(demo):
    msgs = [{"role": "system", "content": "You answer in one line."}]
    for i in range(6):
        msgs.append({"role": "user", "content": f"问题 {i}: " + "这是一个很长的历史消息。" * 3})
        msgs.append({"role": "assistant", "content": f"Answer {i} " + "with some words " * 4})
    msgs.append({"role": "user", "content": "Now, 最后一个问题: what is 2+2?"})
    assert len(demo.tokenizer.encode_chat(msgs)) > WINDOW
    with serve_engine(small_window_engine(demo), context_policy=ContextPolicy.TRUNCATE_OLDEST) as live, \
            live.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        body = r.json()
        dropped = body["brisk"]["truncated_messages"]
        assert dropped >= 1 and r.headers["x-brisk-truncated-messages"] == str(dropped)
        kept = [msgs[0]] + msgs[1 + dropped:]
        assert body["usage"]["prompt_tokens"] == len(demo.tokenizer.encode_chat(kept))
        assert body["usage"]["prompt_tokens"] + 8 <= WINDOW
        # one fewer dropped message would not have fitted: the guard dropped no more than needed
        assert len(demo.tokenizer.encode_chat([msgs[0]] + msgs[dropped:])) + 8 > WINDOW


def test_outcomes_are_counted_in_metrics(demo, policy_server):
    policy, live = policy_server
    with live.client() as http:
        before = guard_counts(http.get("/metrics").text)
        fits = chat_with_tokens(demo.tokenizer, "Hi", 40)
        http.post("/v1/chat/completions", json={"messages": fits, "max_tokens": 2})
        http.post("/v1/chat/completions", json={"messages": fits, "max_tokens": WINDOW})
        after = guard_counts(http.get("/metrics").text)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    over = "clamped" if policy == "clamp-max-tokens" else "rejected"
    assert delta == {**{k: 0 for k in delta}, "ok": 1, over: 1}


def guard_counts(text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == "brisk:context_guard":
            return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}
    return {}
