"""Cost of structured outputs per generated token, in the engine, at 1 and 16 streams.

Modes, alternated in each round, in an order rotated every round, so machine drift hits all alike:
- free:  no grammar (EOS ignored, so every request makes --tokens tokens)
- json:  every request constrained by a JSON schema too long to finish within --tokens
         (an array of >= 64 person objects), so it also makes exactly --tokens tokens
- mixed: half the requests constrained, half free (16 streams only)
Decode tok/s is the streams over the median decode step (steps after every request has its
first token; the median, so a stray stall elsewhere on the machine does not count).
The ratio json/free is the overhead a JSON-schema request pays; mixed/free what a batch pays
when some of its requests have a grammar (rows without one get no mask work). Since the
machine's noise is of the same order as the overhead, the grammar's own time per step (the
sampler's mask and the engine's advance of each matcher) is also timed directly.

    .venv/bin/python benchmarks/structured_overhead.py [--model M] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from decode_speed import read_bandwidth_gbs

from brisk.engine.engine import LLMEngine
from brisk.engine.sampling_params import SamplingParams
from brisk.llm import LLM
from brisk.structured.spec import json_spec

PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}, "email": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "city", "email"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}


class GrammarClock:
    """Seconds spent in grammar work: the sampler's masks and the engine's matcher advances."""

    def __init__(self, llm: LLM):
        self.seconds = 0.0
        masker = llm.engine.runner.sampler.masker
        apply, advance = masker.apply, LLMEngine._grammar_done

        def timed_apply(*args):
            t = time.perf_counter()
            apply(*args)
            self.seconds += time.perf_counter() - t

        def timed_advance(request, token):
            t = time.perf_counter()
            done = advance(request, token)
            self.seconds += time.perf_counter() - t
            return done

        masker.apply = timed_apply
        LLMEngine._grammar_done = staticmethod(timed_advance)


def decode_steps(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                 clock: GrammarClock) -> tuple[list[float], float]:
    """(seconds of each decode step, grammar ms per step) after prefill."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    produced: dict[str, int] = {}
    while len(produced) < len(ids):  # prefill: until every request has its first token
        for out in engine.step():
            produced[out.request_id] = len(out.token_ids)
    grammar_s, steps = clock.seconds, []
    finals = {}
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        assert len(outs) == len(ids) or any(o.finished for o in outs)  # every step decodes every request
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
    for rid in ids:
        assert finals[rid].finish_reason == "length", (rid, finals[rid].text[-80:])
    return steps, (clock.seconds - grammar_s) / len(steps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=16)
    t0 = time.perf_counter()
    llm.grammars.warm_up()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llm.grammars.compile(json_spec(PEOPLE, "response_format"))
    compile_ms = (time.perf_counter() - t0) * 1e3
    tok = llm.tokenizer

    def prompts(n: int, round_: int) -> list[list[int]]:
        return [tok.encode_chat([{"role": "user", "content": f"List people as JSON (batch {round_}, #{i})."}])
                for i in range(n)]

    free = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    json_ = SamplingParams(max_tokens=args.tokens, temperature=0, grammar=grammar)
    cases = {(1, "free"): [free], (1, "json"): [json_], (16, "free"): [free] * 16, (16, "json"): [json_] * 16,
             (16, "mixed"): [json_, free] * 8}
    clock = GrammarClock(llm)
    decode_steps(llm, prompts(16, -1), [free] * 16, clock)  # warm the kernels' row-count paths
    steps: dict[tuple[int, str], list[float]] = {k: [] for k in cases}
    grammar_ms: dict[tuple[int, str], list[float]] = {k: [] for k in cases}
    keys = list(cases)
    for r in range(args.rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            params = cases[key]
            seconds, ms = decode_steps(llm, prompts(len(params), r), params, clock)
            steps[key] += seconds
            grammar_ms[key].append(ms)
    bandwidth, how = read_bandwidth_gbs()
    print(f"model {llm.loaded.name} ({llm.loaded.report.dtype}), {args.tokens} tokens per request, "
          f"median of {args.rounds} rounds; read bandwidth {bandwidth:.1f} GB/s ({how}); "
          f"grammar warm-up {warm_s:.2f} s once per process, schema compile {compile_ms:.1f} ms")
    print("| streams | mode | decode tok/s (all streams) | vs free | step ms | grammar ms per step | grammar share |")
    print("|---|---|---|---|---|---|---|")
    for key, values in steps.items():
        streams, mode = key
        step_ms = statistics.median(values) * 1e3
        median = streams / step_ms * 1e3
        base = streams / statistics.median(steps[(streams, "free")])
        g_ms = statistics.median(grammar_ms[key])
        print(f"| {streams} | {mode} | {median:.1f} | {median / base - 1:+.1%} | {step_ms:.1f} | {g_ms:.2f} | "
              f"{g_ms / step_ms:.1%} |")


if __name__ == "__main__":
    main()
