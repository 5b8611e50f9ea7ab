"""Sampling penalties and logit bias, applied to all rows of a step at once (brisk.engine.sampler),
against references nobody here wrote: transformers' RepetitionPenaltyLogitsProcessor (HF/CTRL
semantics, prompt and output tokens) and OpenAI's documented formula for presence/frequency
penalties (output tokens only): logit[j] -= count[j] * frequency + (count[j] > 0) * presence."""

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from brisk.engine.request import Request
from brisk.engine.sampler import apply_logit_bias, apply_penalties
from brisk.engine.sampling_params import SamplingParams

VOCAB = 50


def _request(i, prompt, output, **penalties):
    request = Request(f"r{i}", prompt, SamplingParams(**penalties))
    for token in output:
        request.append_output(token)
    return request


def test_penalties_match_transformers_and_openai_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    cases = {  # row: (prompt, output, penalties)
        0: ([1, 2, 3, 3], [4, 4, 9], dict(repetition_penalty=1.3)),
        2: ([5, 6], [6, 6, 6, 7], dict(frequency_penalty=0.5, presence_penalty=0.8)),
        3: ([8, 9, 10], [10, 11, 11], dict(repetition_penalty=0.7, frequency_penalty=-0.4, presence_penalty=1.5)),
        4: ([12], [], dict(presence_penalty=2.0, frequency_penalty=2.0)),  # nothing generated yet
    }
    requests = [_request(row, prompt, output, **penalties) for row, (prompt, output, penalties) in cases.items()]
    ours = logits.clone()
    apply_penalties(ours, list(cases), requests)
    for row in range(5):
        expected = logits[row].clone()
        if row in cases:
            prompt, output, penalties = cases[row]
            p = SamplingParams(**penalties)
            if p.repetition_penalty != 1.0:
                ids = torch.tensor([prompt + output])
                expected = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, expected[None])[0]
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB)
            expected = expected - counts * p.frequency_penalty - (counts > 0) * p.presence_penalty
        torch.testing.assert_close(ours[row], expected.float(), rtol=0, atol=1e-6)
    assert torch.equal(ours[1], logits[1])  # a row without penalties is untouched


def test_a_repetition_penalty_near_zero_keeps_rows_finite():
    logits = torch.tensor([[5.0, -5.0, 1.0, 0.0]])
    apply_penalties(logits, [0], [_request(0, [0, 1], [], repetition_penalty=1e-45)])
    # 5 / 1e-45 is inf, clamped finite; -5 * 1e-45 is a tiny negative number
    assert torch.isfinite(logits).all() and logits[0, 0] > 1e30 and -1e-40 < logits[0, 1] <= 0


def test_logit_bias_adds_each_rows_own_biases():
    logits = torch.zeros(3, VOCAB)
    apply_logit_bias(logits, [0, 2], [{3: 5.0, 7: -100.0}, {3: 1.5}])
    expected = torch.zeros(3, VOCAB)
    expected[0, 3], expected[0, 7], expected[2, 3] = 5.0, -100.0, 1.5
    assert torch.equal(logits, expected)
