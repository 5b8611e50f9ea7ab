"""The paged engine on the demo model: greedy batch invariance (1, 8, 64 at once, and 64
under a KV pool so small that preemption happens), agreement with the simple path,
sampling, stop strings, aborts and prefix sharing.

By default (batch-invariant mode, wherever the compiled kernel runs) prompt tokens attend
through the fixed-order paged kernel row by row, so a row's result does not depend on how its
prompt was chunked; with the row-invariant matmul kernels (tests/test_quant.py) greedy output is
then the same in any batch, for the float32 and the quantized model. With
`batch_invariant=False` (`--no-batch-invariant`) prompt chunks take SDPA, which rounds
differently with the chunking (~1e-7); the int8 activation blocks of the quantized layers turn
such a difference into a whole int8 step now and then, which can flip a greedy token."""

import math

import pytest

from brisk.engine.engine import RequestError
from brisk.engine.sampling_params import SamplingParams, SamplingParamsError
from brisk.errors import BriskError
from brisk.generate import generate_ids

from engines import make_engine
from test_demo_reference import PROMPTS

TOPICS = ["rivers", "volcanoes", "bread", "chess", "the moon", "bees", "trains", "jazz", "glaciers", "tea",
          "owls", "bridges", "deserts", "clocks", "whales", "paper", "salt", "kites", "maps", "ice"]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def prompts64(demo):
    texts = PROMPTS + [f"Tell me one fact about {t}." for t in TOPICS] + \
        [f"Write a sentence that uses the word '{t}' twice." for t in TOPICS] + \
        ["Count from 1 to 10.", "Name four seasons."]
    assert len(texts) == 62
    texts += ["A" * 300, "你好" * 120]  # two longer prompts (multi-block, chunked prefill)
    return [demo.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


def run(engine, prompts, params, wave=None):
    """Submit `wave` prompts at a time (all when None); returns token ids in prompt order."""
    results = {}
    wave = wave or len(prompts)
    for start in range(0, len(prompts), wave):
        ids = [engine.add_request(p, params) for p in prompts[start:start + wave]]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
        for rid in ids:
            assert rid in results
    return [results[k].token_ids for k in sorted(results, key=lambda k: int(k.split("-")[1]))]


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
# the simple path (SingleSequenceCache) keeps float32 K/V: an engine compared with it does too
# (the default KV dtype, bf16 on CPUs with AVX-512 BF16, is held to float32 KV in test_kv_dtypes.py)
SIMPLE_KV = "float32"


# The float32 model decodes ~7x slower than the int4 one on CPU (it reads 4 bytes per weight), so
# its one-at-a-time reference runs a quarter of the prompts and both long ones (18 of 64), and the
# batched float32 runs are held to it there and to the 64-at-once run everywhere. The int4 tests
# below hold every prompt to its own run alone.
ALONE = list(range(0, 62, 4)) + [62, 63]


@pytest.fixture(scope="module")
def one_at_a_time(demo_fp32, prompts64):
    """{prompt index: greedy tokens} for the ALONE prompts, each run by itself."""
    got = run(make_engine(demo_fp32, kv_cache_dtype=SIMPLE_KV), [prompts64[i] for i in ALONE], GREEDY, wave=1)
    return dict(zip(ALONE, got))


@pytest.fixture(scope="module")
def all_at_once(demo_fp32, prompts64, one_at_a_time):
    got = run(make_engine(demo_fp32, kv_cache_dtype=SIMPLE_KV), prompts64, GREEDY, wave=64)
    assert {i: got[i] for i in ALONE} == one_at_a_time
    return got


def test_engine_matches_simple_path(demo_fp32, prompts64, one_at_a_time):
    for i in ALONE[:8]:
        assert one_at_a_time[i] == list(generate_ids(demo_fp32, prompts64[i], NUM_TOKENS, ignore_eos=True))


def test_quantized_engine_matches_simple_path(demo, prompts64, monkeypatch):
    """One sequence at a time, the paged engine and the simple path run the same rows. Both on
    the torch attention path: the compiled decode kernel rounds differently from SDPA (within
    1e-6, tests/test_paged_attention_kernel.py), and the int8 activation quantization of the
    quantized layers can turn such a difference into another greedy token after a few steps.
    The fp32 test above runs the engine on the kernel."""
    monkeypatch.setenv("BRISK_ATTENTION", "torch")
    got = run(make_engine(demo, kv_cache_dtype=SIMPLE_KV), prompts64[:8], GREEDY, wave=1)
    assert got == [list(generate_ids(demo, ids, NUM_TOKENS, ignore_eos=True)) for ids in prompts64[:8]]


def test_greedy_batch_invariance_64_at_once(all_at_once):
    """64 prompts in one go (prompts chunked by the 512-token budget, sharing steps with decodes):
    the ALONE prompts' tokens equal their runs alone (checked in the fixture)."""
    assert len(all_at_once) == 64


def test_greedy_batch_invariance_in_waves_of_8(demo_fp32, prompts64, all_at_once):
    assert run(make_engine(demo_fp32, kv_cache_dtype=SIMPLE_KV), prompts64, GREEDY, wave=8) == all_at_once


def test_greedy_invariance_under_preemption(demo_fp32, prompts64, all_at_once):
    engine = make_engine(demo_fp32, num_blocks=64, kv_cache_dtype=SIMPLE_KV)  # 1024 slots for 64 sequences of ~60 tokens
    assert run(engine, prompts64, GREEDY) == all_at_once
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


@pytest.fixture(scope="module")
def int4_one_at_a_time(demo, prompts64):
    return run(make_engine(demo), prompts64, GREEDY, wave=1)


@pytest.mark.parametrize("wave", [8, 64])
def test_quantized_greedy_batch_invariance(demo, prompts64, int4_one_at_a_time, wave):
    """The demo's Q4_1 weights served as int4, default flags: alone, in waves of 8 and of 64 (where
    prompts are chunked by the 512-token budget and share steps with decodes), the same greedy
    tokens."""
    assert run(make_engine(demo), prompts64, GREEDY, wave=wave) == int4_one_at_a_time


def test_quantized_greedy_does_not_depend_on_the_prefix_cache(demo, prompts64, int4_one_at_a_time):
    """Each prompt again on the same engine: now its chat-template prefix (and, the second time,
    the whole prompt but its last token) comes from the prefix cache, and the tokens are the same."""
    engine = make_engine(demo)
    for _ in range(2):
        assert run(engine, prompts64, GREEDY) == int4_one_at_a_time
    assert engine.stats().prefix_cache_hits_tokens > sum(len(p) for p in prompts64) // 2


def test_quantized_greedy_invariance_under_preemption(demo, prompts64, int4_one_at_a_time):
    """Preempted requests recompute their K/V from prompt + outputs as prompt chunks: row by row,
    the same bits as the decode steps that first wrote them."""
    engine = make_engine(demo, num_blocks=64)
    assert run(engine, prompts64, GREEDY) == int4_one_at_a_time
    assert engine.stats().num_preemptions > 0


def test_batch_invariant_mode_needs_the_compiled_kernel(demo, monkeypatch):
    """Asked for, it is an error where the kernel does not run; by default it is then off."""
    monkeypatch.setenv("BRISK_ATTENTION", "torch")
    with pytest.raises(BriskError, match="--batch-invariant needs"):
        make_engine(demo, batch_invariant=True)
    assert make_engine(demo, num_blocks=64).runner.batch_invariant is False
    monkeypatch.delenv("BRISK_ATTENTION")
    assert make_engine(demo, num_blocks=64).runner.batch_invariant is True
    assert make_engine(demo, num_blocks=64, batch_invariant=False).runner.batch_invariant is False


def test_prefix_sharing_saves_blocks_and_keeps_outputs(demo):
    system = "You are a meticulous assistant. " * 40
    prompts = [demo.tokenizer.encode_chat([{"role": "system", "content": system},
                                           {"role": "user", "content": f"Say the number {i}."}]) for i in range(4)]
    shared, plain = make_engine(demo, prefix=True), make_engine(demo, prefix=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out_shared = [run(shared, [p], params)[0] for p in prompts]
    out_plain = run(plain, prompts, params)
    assert out_shared == out_plain
    stats = shared.stats()
    assert stats.prefix_cache_hits_tokens >= 3 * (len(prompts[0]) // 16 - 1) * 16
    assert plain.stats().prefix_cache_hits_tokens == 0


def test_burst_shares_a_prefix_computed_in_the_same_step(demo):
    """All requests arrive together: the later ones attend to K/V the first one writes in
    that same forward; outputs must equal a run with no sharing at all."""
    system = "You are a meticulous assistant. " * 12
    prompts = [demo.tokenizer.encode_chat([{"role": "system", "content": system},
                                           {"role": "user", "content": f"Say the number {i}."}]) for i in range(6)]
    shared, plain = make_engine(demo, prefix=True, max_num_batched_tokens=2048), make_engine(demo, prefix=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert run(shared, prompts, params) == run(plain, prompts, params)
    assert shared.stats().prefix_cache_hits_tokens >= 5 * (len(prompts[0]) // 16 - 1) * 16


def test_seeded_sampling_is_independent_of_batch(demo, prompts64):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = run(make_engine(demo), prompts64[:1], params)
    batched = run(make_engine(demo), prompts64[:6], params)
    assert batched[0] == alone[0]
    assert len({tuple(b) for b in batched}) > 1  # different prompts, different samples


def test_stop_string_is_never_emitted(demo):
    engine = make_engine(demo)
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    full = run(engine, [prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    text = demo.tokenizer.decode(full)
    stop = "4\n5."  # spans several tokens
    assert stop in text
    rid = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.delta_text)
            final = out
    assert final.request_id == rid and final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[: text.index(stop)]
    assert "".join(deltas) == final.text and all(stop not in d for d in deltas)


def test_logprobs_and_penalties(demo):
    engine = make_engine(demo)
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Repeat: la la la la la"}])
    out = run(engine, [prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=3))
    results = []
    while engine.has_unfinished_requests():
        results += engine.step()
    lps = results[-1].logprobs
    assert [lp["token_id"] for lp in lps] == out
    for lp in lps:  # greedy: the chosen token is the top alternative
        assert len(lp["top"]) == 3 and lp["top"][0][0] == lp["token_id"]
        assert lp["logprob"] == pytest.approx(lp["top"][0][1]) and lp["logprob"] <= 0
    # long enough that the greedy reply repeats tokens whatever the kernels' rounding (a 12-token
    # reply did not, after a change of float summation order)
    plain = run(engine, [prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    penalized = run(engine, [prompt], SamplingParams(max_tokens=32, temperature=0, frequency_penalty=2.0,
                                                     presence_penalty=1.0, ignore_eos=True))[0]
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731  (tokens that occurred before)
    assert repeats(plain) >= 2, "the premise: the unpenalized reply repeats tokens"
    assert penalized != plain and repeats(penalized) < repeats(plain)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_extreme_repetition_penalty_keeps_logprobs_finite(demo, temperature):
    """A valid but extreme penalty divides logits into inf (NaN after inf - inf); logprobs must
    stay finite numbers (JSON has no NaN) and floor at -9999 like OpenAI's."""
    engine = make_engine(demo)
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "hello hello"}])
    for penalty in (1e-30, 1e-300):
        params = SamplingParams(max_tokens=3, temperature=temperature, repetition_penalty=penalty, logprobs=5)
        engine.add_request(prompt, params)
        final = [o for o in iter_steps(engine) if o.finished][0]
        values = [e["logprob"] for e in final.logprobs] + [lp for e in final.logprobs for _, lp in e["top"]]
        assert len(final.token_ids) == 3
        assert all(math.isfinite(v) and -9999.0 <= v <= 0.0 for v in values), values


def iter_steps(engine):
    while engine.has_unfinished_requests():
        yield from engine.step()


def test_abort_frees_blocks(demo, prompts64):
    engine = make_engine(demo)
    rid = engine.add_request(prompts64[0], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    assert engine.abort(rid)
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()
    assert not engine.abort(rid)


def test_invalid_requests(demo):
    engine = make_engine(demo)
    with pytest.raises(RequestError, match="max_tokens: prompt .* exceeds max_model_len 1024"):
        engine.add_request([1] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="prompt: is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(SamplingParamsError, match="top_p: must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(SamplingParamsError, match="logprobs: must be in \\[0, 20\\]"):
        SamplingParams(logprobs=21)



def _all_outputs(engine, prompt, params):
    engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_delta_outputs_cost_o_of_l_and_carry_the_same_result(demo, prompts64):
    """With output_kind="delta" a step's output holds only the new token (and its logprobs); the
    whole output, logprobs and timings come once, on the final output; the prompt's P ids on the
    first and the final. The elements the engine copies into outputs over a request of L tokens
    are O(L + P), against L(L+1)/2 + L*P cumulative."""
    length = 48
    engine = make_engine(demo)
    common = dict(max_tokens=length, temperature=0, ignore_eos=True, logprobs=2)
    cumulative = _all_outputs(engine, prompts64[0], SamplingParams(**common))
    delta = _all_outputs(engine, prompts64[0], SamplingParams(**common, output_kind="delta"))
    assert len(delta) == len(cumulative) == length

    def copied(outs):
        return sum(len(o.token_ids) + len(o.logprobs or []) + len(o.metrics) + len(o.prompt_token_ids)
                   for o in outs)

    final_metrics, prompt = len(delta[-1].metrics), prompts64[0]
    # the final output's token ids and logprobs, the prompt on the first and final outputs
    assert copied(delta) == 2 * length + final_metrics + 2 * len(prompt)
    assert copied(cumulative) >= length * (length + 1) + length * len(prompt)
    assert delta[0].prompt_token_ids == delta[-1].prompt_token_ids == cumulative[5].prompt_token_ids == prompt
    assert all(o.prompt_token_ids == [] for o in delta[1:-1])
    assert all(o.token_ids == [] and o.logprobs is None and o.metrics == {} for o in delta[:-1])
    assert [t for o in delta for t in o.delta_token_ids] == delta[-1].token_ids == cumulative[-1].token_ids
    assert [lp for o in delta for lp in o.delta_logprobs] == delta[-1].logprobs == cumulative[-1].logprobs
    assert "".join(o.delta_text for o in delta) == delta[-1].text == cumulative[-1].text
    assert all(o.text == "" for o in delta[:-1])  # the cumulative text rides on the final output only
    # where each delta starts, as the cumulative outputs count it (streamed logprobs' text_offset)
    assert [o.text_offset for o in delta] == [len(c.text) - len(c.delta_text) for c in cumulative]
    assert [o.text_offset for o in delta] == [o.text_offset for o in cumulative]
    assert [o.num_output_tokens for o in delta] == list(range(1, length + 1))
    assert delta[-1].metrics.keys() == cumulative[-1].metrics.keys()


def test_output_kind_is_validated():
    with pytest.raises(SamplingParamsError, match="output_kind: must be one of cumulative, delta, got 'final'"):
        SamplingParams(output_kind="final")


def test_prompt_token_count_is_what_prefill_computed(demo, prompts64):
    """EngineStats.prompt_tokens (the stats line's "prompt tok/s") counts prompt tokens as they
    are prefilled, chunk by chunk, not when the request arrives; prefix-cache hits are not
    computed and not counted."""
    engine = make_engine(demo, max_num_batched_tokens=64)
    prompt = [t for p in prompts64[:6] for t in p][:150]  # > 2 chunks of 64
    engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0))
    assert engine.stats().prompt_tokens == 0  # arrived, nothing computed yet
    engine.step()
    assert engine.stats().prompt_tokens == 64
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().prompt_tokens == 150
    again = _all_outputs(engine, prompt, SamplingParams(max_tokens=2, temperature=0))
    cached = again[-1].num_cached_prompt_tokens
    assert cached >= 128
    assert engine.stats().prompt_tokens == 150 + (150 - cached)
