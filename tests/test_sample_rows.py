"""Batched sampling (brisk/engine/sample_rows.py) draws from exactly the distribution that the
per-row reference `filtered_probs` defines, for every combination of temperature, top-k, top-p and
min-p, on peaked and on flat rows (flat rows with top-p take the whole-row sort, since their
nucleus is wider than the candidates).

How: sample_rows draws by inverse CDF from one uniform per row, so N copies of a row with the
uniforms (i + 0.5) / N give each token a share within 1/N of its probability (plus float
rounding of the cumulative sums). The test compares those shares with filtered_probs'."""

import pytest
import torch

from brisk.engine.request import Request
from brisk.engine.sample_rows import CANDIDATES, sample_rows
from brisk.engine.sampler import Sampler, filtered_probs
from brisk.engine.sampling_params import SamplingParams

N = 4000
VOCAB = 600  # > CANDIDATES, so a wide nucleus leaves the candidates


def _rows(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if kind == "peaked":
        return torch.randn(VOCAB, generator=g) * 4
    if kind == "flat":
        return torch.randn(VOCAB, generator=g) * 0.3
    row = torch.randn(VOCAB, generator=g)  # with -inf, NaN and a huge logit
    row[:5] = torch.tensor([float("-inf"), float("nan"), 1e38, 3.0, 3.0])
    return row


SETTINGS = [
    dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.8, top_k=40), dict(temperature=0.9, top_p=0.9), dict(temperature=1.0, top_p=0.5, min_p=0.02),
    dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05), dict(temperature=1.0, top_k=VOCAB + 5),
    dict(temperature=1.0, top_k=300, top_p=0.95), dict(temperature=0.6, top_p=1e-300),
]


@pytest.mark.parametrize("kind", ["peaked", "flat", "special"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_batched_sampling_draws_filtered_probs_distribution(kind, settings):
    params = SamplingParams(**settings)
    row = _rows(kind)
    expected = filtered_probs(row.clone(), Request("ref", [1], params))
    expected = expected / expected.sum()
    uniforms = (torch.arange(N, dtype=torch.float32) + 0.5) / N
    tokens = sample_rows(row.repeat(N, 1), [params] * N, uniforms)
    shares = torch.bincount(tokens, minlength=VOCAB).float() / N
    assert shares[expected == 0].sum() == 0  # never a token the filters removed
    assert (shares - expected).abs().max() <= 1.5 / N + 1e-4


def test_a_wide_nucleus_is_sorted_whole():
    """Flat row, top_p 0.99: the nucleus holds far more tokens than the candidates."""
    params = SamplingParams(temperature=1.0, top_p=0.99)
    row = _rows("flat")
    kept = (filtered_probs(row.clone(), Request("ref", [1], params)) > 0).sum()
    assert kept > CANDIDATES
    tokens = sample_rows(row.repeat(N, 1), [params] * N, (torch.arange(N, dtype=torch.float32) + 0.5) / N)
    assert len(tokens.unique()) > CANDIDATES


def test_rows_with_different_settings_in_one_batch():
    rows = torch.stack([_rows("peaked"), _rows("flat"), _rows("special")])
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.9, top_p=0.3)]
    for u in (1e-6, 0.5, 1.0):
        tokens = sample_rows(rows.clone(), params, torch.full((3,), u))
        for i in range(3):  # each row alone gives the same token
            alone = sample_rows(rows[i:i + 1].clone(), params[i:i + 1], torch.full((1,), u))
            assert tokens[i] == alone[0]
        assert tokens[0] in rows[0].topk(5).indices


def test_seeded_request_gets_the_same_token_alone_or_batched():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)) * 3
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)

    def sample(rows):
        sampler = Sampler(torch.device("cpu"))
        requests = [Request(f"r{i}", [1], seeded if i == 0 else SamplingParams(temperature=1.0)) for i in rows]
        return sampler(logits[rows].clone(), requests).token_ids[0].item()

    assert sample([0]) == sample([0, 1, 2, 3])
