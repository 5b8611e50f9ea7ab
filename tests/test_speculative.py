"""Speculative decoding (n-gram): the config's errors, the proposer, the verification rules, and
the engine end to end on the demo model. Greedy output with speculation must equal output without
it token for token; sampled output must follow the same distribution (chi-square tests)."""

import math

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from brisk.config import CacheConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.kv_cache.manager import KVCacheManager
from brisk.engine.request import Request
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import Scheduler, SchedulerConfig
from brisk.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from brisk.engine.spec_decode.ngram import NgramIndex
from brisk.engine.spec_decode.policy import FIRST_COOLDOWN, SpecState
from brisk.engine.spec_decode.verify import verify_greedy, verify_sampled

P_VALUE = 1e-3  # a correct sampler fails a test at this threshold once in a thousand seeds; seeds are fixed


# -- config -----------------------------------------------------------------
@pytest.mark.parametrize("text,needle", [
    ('{"method": "eagle", "num_speculative_tokens": 4}', "unknown method 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in [1, 16], got 0"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "got 17"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer, got '4'"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min (5) exceeds"),
    ('{"method": "ngram", "prompt_lookup_min": 0}', "prompt_lookup_min must be an integer >= 1"),
    ('{"method": "ngram", "lookahead": 3}', "unknown key(s) lookahead"),
    ('{"num_speculative_tokens": 4}', "needs \"method\""),
    ('{"method": "draft_model"}', "needs \"model\""),
    ('{"method": "ngram", "model": "x"}', "takes no \"model\""),
    ('[4]', "must be a JSON object"),
    ('{method: ngram}', "not valid JSON"),
    ('{"method": "ngram", "min_acceptance_rate": 1.5}', "min_acceptance_rate must be in [0, 1)"),
])
def test_bad_speculative_config_is_one_clear_error(text, needle):
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeConfig.parse(text)
    assert needle in str(e.value)


def test_speculative_config_defaults_and_vllm_shape():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 2, 3)
    c = SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_min": 6}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens) == (6, 6, 4)
    assert c.min_acceptance_rate == 0.1
    c = SpeculativeConfig.parse('{"model": "/models/draft", "num_speculative_tokens": 3}')
    assert (c.method, c.model, c.min_acceptance_rate) == ("draft_model", "/models/draft", 0.3)


# -- the n-gram proposer ---------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_recent_match():
    index = NgramIndex(2, 4)
    #         0  1  2  3  4  5  6  7  8  9 10 11 12 13
    prompt = [5, 1, 2, 3, 9, 9, 7, 2, 3, 8, 8, 1, 2, 3]
    index.extend(prompt)
    # "2 3" ends at 3 (after "1 2 3": a 3-gram) and at 8 (after "7 2 3": only the 2-gram): the
    # longer match wins although it is older
    assert index.propose(3) == [9, 9, 7]
    assert index.propose(1) == [9]
    index.extend(prompt + [9, 9])  # the sequence grows: "3 9 9" now matches at 5
    assert index.propose(4) == [7, 2, 3, 8]


def test_ngram_without_a_match_or_budget_proposes_nothing():
    index = NgramIndex(3, 5)
    index.extend([1, 2, 3, 4, 5, 6])
    assert index.propose(4) == []  # "4 5 6" occurs once: only itself
    index.extend([1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert index.propose(4) == [4, 5, 6, 1]  # the proposal may run into the current repeat
    assert index.propose(0) == []


def test_ngram_prefers_the_most_recent_of_equal_matches():
    index = NgramIndex(2, 2)
    index.extend([1, 2, 7, 1, 2, 8, 1, 2])
    assert index.propose(1) == [8]


# -- verification rules ----------------------------------------------------------
def test_greedy_verification_accepts_the_matching_prefix():
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == 4  # all accepted + the bonus token
    assert verify_greedy([4, 9, 6, 7], [4, 5, 6]) == 2  # 4 accepted, then the target's 9
    assert verify_greedy([1, 5, 6, 7], [4, 5, 6]) == 1  # nothing accepted: the target's own token


def test_rejection_sampling_keeps_the_target_distribution_of_the_first_token():
    """Vocabulary of 6, one drafted token with target probability 0.3: the emitted token's
    frequencies over 20,000 draws follow p (chi-square goodness of fit)."""
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0])
    gen = torch.Generator().manual_seed(7)
    counts = [0] * 6
    accepted = 0
    for _ in range(20_000):
        out = verify_sampled(torch.stack([p, p]), [0], gen)
        counts[out[0]] += 1
        accepted += len(out) == 2
    assert counts[5] == 0  # a token the target rules out is never emitted
    expected = [20_000 * float(x) / float(p.sum()) for x in p[:5]]
    expected[-1] = 20_000 - sum(expected[:-1])  # sums agree exactly (scipy checks)
    assert chisquare(counts[:5], expected).pvalue > P_VALUE
    assert abs(accepted / 20_000 - 0.3) < 0.02  # a drafted token is accepted with probability p(d)


def test_rejection_sampling_keeps_the_distribution_of_three_token_continuations():
    """A Markov chain over 4 tokens stands in for the target; the draft is a fixed guess that is
    sometimes right. Speculative sampling of 3-token continuations must give the chain's own
    distribution (64 categories, chi-square against the exact probabilities)."""
    rng = torch.Generator().manual_seed(3)
    chain = torch.softmax(torch.randn(4, 4, generator=rng) * 1.5, dim=-1)  # p(next | previous)
    guess = {0: [1, 2, 3], 1: [2, 2, 0], 2: [0, 1, 1], 3: [3, 3, 3]}  # drafted after each start token
    gen = torch.Generator().manual_seed(11)
    counts = {}
    for _ in range(20_000):
        out, last = [], 0
        while len(out) < 3:
            draft = guess[last][:3 - len(out)]
            rows, prev = [], last
            for token in draft:  # the target's distribution at each drafted position
                rows.append(chain[prev])
                prev = token
            rows.append(chain[prev])
            emitted = verify_sampled(torch.stack(rows), draft, gen)
            out += emitted
            last = out[-1]
        key = tuple(out[:3])
        counts[key] = counts.get(key, 0) + 1
    expected, observed = [], []
    for a in range(4):
        for b in range(4):
            for c in range(4):
                expected.append(20_000 * float(chain[0, a] * chain[a, b] * chain[b, c]))
                observed.append(counts.get((a, b, c), 0))
    assert sum(observed) == 20_000
    expected = [20_000 * e / sum(expected) for e in expected]
    expected[-1] = 20_000 - sum(expected[:-1])
    assert chisquare(observed, expected).pvalue > P_VALUE


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution():
    """A draft model samples its tokens from its own q: accept with min(1, p/q), correct from
    max(0, p - q). Over 3-token continuations of two different Markov chains (target p, draft q),
    the emitted continuations follow p (chi-square, 64 categories)."""
    rng = torch.Generator().manual_seed(4)
    p_chain = torch.softmax(torch.randn(4, 4, generator=rng) * 1.5, dim=-1)
    q_chain = torch.softmax(torch.randn(4, 4, generator=rng) * 1.5, dim=-1)
    gen = torch.Generator().manual_seed(12)
    counts, accepted, drafted = {}, 0, 0
    for _ in range(15_000):
        out, last = [], 0
        while len(out) < 3:
            draft, q_rows, p_rows, prev = [], [], [], last
            for _ in range(3 - len(out)):  # the draft runs ahead on its own chain
                q_rows.append(q_chain[prev])
                p_rows.append(p_chain[prev])
                prev = int(torch.multinomial(q_chain[prev], 1, generator=gen)[0])
                draft.append(prev)
            p_rows.append(p_chain[prev])
            emitted = verify_sampled(torch.stack(p_rows), draft, gen, torch.stack(q_rows))
            accepted += len(emitted) - 1 if len(emitted) <= len(draft) else len(draft)
            drafted += len(draft)
            out += emitted
            last = out[-1]
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
    expected = [float(p_chain[0, a] * p_chain[a, b] * p_chain[b, c])
                for a in range(4) for b in range(4) for c in range(4)]
    expected = [15_000 * e / sum(expected) for e in expected]
    expected[-1] = 15_000 - sum(expected[:-1])
    observed = [counts.get((a, b, c), 0) for a in range(4) for b in range(4) for c in range(4)]
    assert chisquare(observed, expected).pvalue > P_VALUE
    assert 0.2 < accepted / drafted < 0.95  # the chains differ: partial acceptance


# -- policy and KV bookkeeping (pure Python) ------------------------------------
def test_low_acceptance_pauses_drafting_with_a_growing_cooldown():
    state = SpecState(NgramIndex(2, 4))
    state.record(4, 4, 0.2)
    assert state.ready() and state.ema == 1.0
    for _ in range(5):  # 1 -> 0.7 -> 0.49 -> 0.34 -> 0.24 -> 0.17 < 0.2
        state.record(4, 0, 0.2)
    assert state.cooldown_left == FIRST_COOLDOWN
    assert not any(state.ready() for _ in range(FIRST_COOLDOWN))
    assert state.ready() and state.ema == 0.5
    state.record(4, 0, 0.2)
    state.record(4, 0, 0.2)  # 0.5 -> 0.35 -> 0.245; a third miss pauses it, twice as long
    state.record(4, 0, 0.2)
    assert state.cooldown_left == 2 * FIRST_COOLDOWN
    assert (state.num_drafted, state.num_accepted) == (36, 4)


def test_truncate_returns_rejected_draft_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("a", list(range(7)), SamplingParams())
    kv.allocate_slots(r, 7, kv.find_cached_prefix(r))
    kv.cache_full_blocks(r, 7)
    kv.allocate_slots(r, 5)  # the last token + 4 drafted: 12 slots, 3 blocks
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 5
    kv.truncate("a", 8)  # one draft accepted: positions 0..7 are valid
    assert len(kv.block_ids("a")) == 2 and kv.num_free_blocks == 6
    assert kv.req_num_tokens["a"] == 8
    kv.truncate("a", 9)  # never grows
    assert kv.req_num_tokens["a"] == 8
    assert kv.pool.blocks[kv.block_ids("a")[1]].block_hash is None  # the drafted block was never cached


def _decoding(request_id, prompt_len, output, draft):
    r = Request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=64))
    for token in output:
        r.append_output(token)
    r.spec_token_ids = list(draft)
    return r


def test_scheduler_counts_drafts_against_the_budget_and_memory():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64), kv)
    r = _decoding("a", 6, [1], [])
    sched.add_request(r)
    sched.advance(sched.schedule())  # the 7-token prompt in one chunk
    assert r.num_computed_tokens == 7
    r.append_output(2)
    r.spec_token_ids = list(range(10, 19))
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.num_tokens, chunk.num_draft) == (8, 7)  # the budget of 8 keeps 7 of 9 drafts
    assert len(kv.block_ids("a")) == 4  # slots for 15 tokens
    sched.advance(out)
    assert r.num_computed_tokens == 8  # drafted positions are not counted until accepted
    kv.truncate("a", 8)  # none accepted
    assert len(kv.block_ids("a")) == 2 and kv.num_free_blocks == 4
    # a draft that needs memory somebody else holds is dropped; nobody is preempted for it
    kv.allocate_slots(_decoding("hog", 11, [], []), 12)  # 3 of the 4 free blocks
    r.append_output(3)
    r.spec_token_ids = [1, 2, 3, 4, 5]  # 14 slots = 4 blocks: 2 more, only 1 free
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.num_tokens, chunk.num_draft) == (1, 0) and not out.preempted


# -- the engine on the demo model ------------------------------------------------
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
NUM_TOKENS = 12
TEXTS = ["The quick brown fox jumps over the lazy dog near the river bank.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
         "Paris is the capital of France. Berlin is the capital of Germany.",
         "Roses are red, violets are blue, sugar is sweet, and so are you.",
         "SELECT name, price FROM products WHERE price > 10 ORDER BY price;",
         "Le chat dort sur le canapé pendant que le chien joue dans le jardin.",
         "El sol sale por el este y se pone por el oeste todos los días.",
         "一二三四五六七八九十，春夏秋冬。"]
EDITS = ["Repeat this text exactly:\n", "Copy the following, changing nothing:\n", "Rewrite this, fixing typos:\n",
         "Quote the text below:\n"]
TOPICS = ["the moon", "tea", "rivers", "bicycles", "music", "winter", "bread", "owls"]


@pytest.fixture(scope="module")
def spec_prompts(demo):
    """64 prompts: 32 input-grounded (n-gram drafts fire and get accepted) and 32 ordinary."""
    texts = [e + t for e in EDITS for t in TEXTS]
    texts += [f"Tell me one fact about {t}." for t in TOPICS] + [f"Write a line about {t}." for t in TOPICS]
    texts += [f"What is {t} like?" for t in TOPICS] + [f"Name two things related to {t}." for t in TOPICS]
    return [demo.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


def engine_for(loaded, spec=None, num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512, kv="auto"):
    return LLMEngine(loaded, CacheConfig(block_size=16, num_gpu_blocks_override=num_blocks, kv_cache_dtype=kv),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=1024), speculative=spec)


def run(engine, prompts, params, wave=None):
    finals = {}
    wave = wave or len(prompts)
    order = []
    for start in range(0, len(prompts), wave):
        order += [engine.add_request(p, params) for p in prompts[start:start + wave]]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    return [finals[rid] for rid in order]


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(demo, spec_prompts):
    """Greedy without speculation, on the demo's int4 weights with default flags (what users run;
    batch-invariant, tests/test_engine_batching.py): a speculative step verifies k + 1 rows per
    request where plain decoding computes one, and each row must come out the same bits."""
    return [o.token_ids for o in run(engine_for(demo), spec_prompts, GREEDY)]


def test_greedy_with_ngram_speculation_equals_plain_decoding_at_batch_1(demo, spec_prompts, reference):
    engine = engine_for(demo, NGRAM)
    assert [o.token_ids for o in run(engine, spec_prompts, GREEDY, wave=1)] == reference
    stats = engine.stats()
    # drafts were made, and both accepted and rejected ones were exercised
    assert stats.spec_accepted_tokens > 0.3 * stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.num_steps < 64 * NUM_TOKENS * 0.9 + 64  # fewer decode steps than tokens
    assert stats.kv_blocks_used == 0


def test_greedy_with_ngram_speculation_equals_plain_decoding_at_batch_16(demo, spec_prompts, reference):
    engine = engine_for(demo, SpeculativeConfig(disable_by_batch_size=16))
    assert [o.token_ids for o in run(engine, spec_prompts, GREEDY, wave=16)] == reference
    assert engine.stats().spec_accepted_tokens > 0


def test_greedy_with_ngram_speculation_under_preemption(demo, spec_prompts, reference):
    engine = engine_for(demo, SpeculativeConfig(disable_by_batch_size=64), num_blocks=64)
    assert [o.token_ids for o in run(engine, spec_prompts, GREEDY)] == reference
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_logprobs_with_speculation_are_the_targets(demo_fp32, spec_prompts):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    prompts = spec_prompts[:4]
    # float32 KV: with bf16 KV (this CPU's auto) the logprobs moved by more than 1e-4 between the two
    # runs in the 2026-12-03 suite; not explained yet (the tokens agree; see the stop's note)
    plain = run(engine_for(demo_fp32, kv="float32"), prompts, params, wave=1)
    engine = engine_for(demo_fp32, NGRAM, kv="float32")
    spec = run(engine, prompts, params, wave=1)
    assert engine.stats().spec_accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and len(b.logprobs) == NUM_TOKENS
        for x, y in zip(a.logprobs, b.logprobs):
            assert x["token_id"] == y["token_id"]
            # verification runs 5 rows per request through the fp32 GEMMs where plain decoding runs
            # 1, and the GEMM kernels sum in a different order per row count: up to 2.5e-5 measured
            # on an AVX-512 machine. A logprob of the wrong position or distribution is off by >1e-2.
            assert math.isclose(x["logprob"], y["logprob"], abs_tol=1e-4)
            assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]
        assert b.metrics["spec_drafted_tokens"] >= b.metrics["spec_accepted_tokens"]


def test_requests_that_cannot_speculate_decode_one_token_per_step(demo, spec_prompts):
    engine = engine_for(demo, NGRAM)
    for params in (SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, speculative=False),
                   SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=1.1)):
        run(engine, spec_prompts[:2], params, wave=1)
    assert engine.stats().spec_draft_tokens == 0


def test_no_drafting_above_the_batch_size_rule(demo, spec_prompts):
    engine = engine_for(demo, SpeculativeConfig(disable_by_batch_size=2))
    run(engine, spec_prompts[:8], GREEDY)  # 8 running at once: nobody drafts until only 2 are left
    drafted_together = engine.stats().spec_draft_tokens
    alone = engine_for(demo, SpeculativeConfig(disable_by_batch_size=2))
    run(alone, spec_prompts[:8], GREEDY, wave=1)
    assert drafted_together < alone.stats().spec_draft_tokens / 2


SAMPLES = 300


def test_sampled_output_with_speculation_follows_the_same_distribution(demo):
    """End to end on the demo model: a prompt whose continuation the n-gram proposer can guess,
    top-k 3 at temperature 1, 300 samples of the first three generated tokens with and without
    speculation; chi-square test of homogeneity over the continuations seen."""
    text = "one two three four five six " * 6 + "one two"  # "five six" is always followed by " one"
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Continue the pattern: " + text}])
    prompt += demo.tokenizer.encode("one two three four five")
    prompt = prompt[(len(prompt) - 1) % 16:]  # full blocks + 1: each request computes one prompt token
    samples = {}
    for name, spec in (("plain", None), ("spec", SpeculativeConfig(disable_by_batch_size=100))):
        engine = engine_for(demo, spec, max_num_seqs=100, max_num_batched_tokens=2048)
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=10_000 * (spec is not None) + i,
                                 ignore_eos=True) for i in range(SAMPLES)]
        finals = {}
        for start in range(0, SAMPLES, 100):
            ids = [engine.add_request(prompt, p) for p in params[start:start + 100]]
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = tuple(out.token_ids)
            assert all(i in finals for i in ids)
        samples[name] = list(finals.values())
        if spec is not None:
            stats = engine.stats()
            assert stats.spec_accepted_tokens > 0 and stats.spec_accepted_tokens < stats.spec_draft_tokens
    keys = sorted(set(samples["plain"]) | set(samples["spec"]))
    table = [[samples[name].count(k) for k in keys] for name in ("plain", "spec")]
    common = [i for i in range(len(keys)) if table[0][i] + table[1][i] >= 10]  # pool rare continuations
    rare = [i for i in range(len(keys)) if i not in common]
    rows = [[row[i] for i in common] + [sum(row[i] for i in rare)] for row in table]
    if not rare:
        rows = [r[:-1] for r in rows]
    assert len(rows[0]) >= 2
    assert chi2_contingency(rows).pvalue > P_VALUE


# -- through the server ----------------------------------------------------------
def test_server_reports_speculation_in_usage_and_honours_opt_out(demo):
    from live_server import serve_engine

    engine = engine_for(demo, NGRAM)
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 3
    messages = [{"role": "user", "content": "Repeat this text exactly:\n" + text}]
    with serve_engine(engine) as live:
        client = live.openai()
        on = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=24, temperature=0)
        off = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=24, temperature=0,
                                             extra_body={"speculative": False})
        bad = live.client().post("/v1/chat/completions",
                                 json={"messages": messages, "speculative": "maybe"})
    usage = on.usage.model_extra["brisk"]
    assert usage["spec_accepted_tokens"] > 0 and usage["spec_drafted_tokens"] >= usage["spec_accepted_tokens"]
    assert "spec_drafted_tokens" not in off.usage.model_extra["brisk"]
    assert on.choices[0].message.content == off.choices[0].message.content
    assert bad.status_code == 400 and "speculative" in bad.text


# -- draft-model speculation -------------------------------------------------------
DRAFT_LAYERS = 20  # of the demo's 30: a real, smaller draft that agrees with it only in part


@pytest.fixture(scope="session")
def draft_path(tmp_path_factory, demo_gguf_path):
    from brisk.loading.gguf_random import write_truncated_gguf

    return write_truncated_gguf(demo_gguf_path, tmp_path_factory.mktemp("draft") / "draft.gguf", DRAFT_LAYERS)


@pytest.fixture(scope="module")
def draft(draft_path, demo):
    from brisk.loading.loader import load

    return load(str(draft_path), max_model_len=demo.max_model_len, warmup=False)


def draft_config(draft_path, **kw):
    return SpeculativeConfig(method="draft_model", model=str(draft_path), num_speculative_tokens=4,
                             min_acceptance_rate=0.0, **kw)


def draft_engine(target, draft, path, **kw):
    engine_kw = {k: kw.pop(k) for k in ("num_blocks",) if k in kw}
    return LLMEngine(target, CacheConfig(block_size=16, num_gpu_blocks_override=engine_kw.get("num_blocks", 2048)),
                     SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024),
                     speculative=draft_config(path, **kw), draft=draft)


def _partial_acceptance(engine):
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    return stats


def test_greedy_with_a_draft_model_equals_plain_decoding_at_batch_1(demo, draft, draft_path,
                                                                     spec_prompts, reference):
    # (a draft step costs k draft forwards and one target forward: 16 prompts one at a time here;
    # all 64 at batch 16 and under preemption below)
    engine = draft_engine(demo, draft, draft_path)
    assert [o.token_ids for o in run(engine, spec_prompts[::4], GREEDY, wave=1)] == reference[::4]
    _partial_acceptance(engine)


def test_greedy_with_a_draft_model_equals_plain_decoding_at_batch_16(demo, draft, draft_path,
                                                                      spec_prompts, reference):
    engine = draft_engine(demo, draft, draft_path, disable_by_batch_size=16)
    assert [o.token_ids for o in run(engine, spec_prompts, GREEDY, wave=16)] == reference
    _partial_acceptance(engine)


def test_greedy_with_a_draft_model_under_preemption(demo, draft, draft_path, spec_prompts, reference):
    engine = draft_engine(demo, draft, draft_path, disable_by_batch_size=64, num_blocks=64)
    assert [o.token_ids for o in run(engine, spec_prompts, GREEDY)] == reference
    stats = _partial_acceptance(engine)
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0


def test_sampled_draft_model_requests_run_and_report_their_counts(demo, draft, draft_path, spec_prompts):
    engine = draft_engine(demo, draft, draft_path)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=1)
    outs = run(engine, spec_prompts[:4], params, wave=1)
    assert all(len(o.token_ids) == NUM_TOKENS and len(o.logprobs) == NUM_TOKENS for o in outs)
    assert sum(o.metrics["spec_drafted_tokens"] for o in outs) == engine.stats().spec_draft_tokens > 0


def test_a_draft_with_another_vocabulary_or_not_smaller_is_refused(demo, draft, draft_path, tmp_path):
    from brisk.loading.gguf_random import Shape, write_random_gguf
    from brisk.loading.loader import load

    other = write_random_gguf(tmp_path / "other.gguf", Shape(hidden=64, layers=1, ffn=128, heads=2, kv_heads=1),
                              "F32", None, small_vocab=128)
    small = load(str(other), quantization="none", max_model_len=1024, warmup=False)
    with pytest.raises(SpeculativeConfigError, match="vocabulary differs from the target's"):
        draft_engine(demo, small, other)
    with pytest.raises(SpeculativeConfigError, match="is not smaller than the target"):
        draft_engine(draft, demo, "demo")  # the 30-layer model drafting for the 20-layer one


def test_offline_api_takes_vllms_speculative_config(demo):
    from brisk.llm import LLM

    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 3
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Repeat this text exactly:\n" + text}])
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(num_blocks=256, max_model_len=1024).generate(prompt, params)[0]
    llm = LLM(num_blocks=256, max_model_len=1024, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec = llm.generate(prompt, params)[0]
    assert spec.token_ids == plain.token_ids and llm.engine.stats().spec_accepted_tokens > 0
    with pytest.raises(SpeculativeConfigError, match="unknown method"):
        LLM(num_blocks=256, max_model_len=1024, speculative_config={"method": "medusa"})
