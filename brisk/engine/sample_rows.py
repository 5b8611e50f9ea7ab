"""Sampling a batch of rows at once: temperature, top-k, top-p, min-p as tensor ops over all rows,
one uniform draw per row (inverse CDF), no per-row softmax, sort or multinomial.

The per-row `filtered_probs` (brisk.engine.sampler) defines the distribution; this computes the
same one (tests/test_sample_rows.py holds it to it) faster:
- rows with neither top-k nor top-p sample over the whole vocabulary;
- rows with top-k or top-p sample among their K most likely tokens (`torch.topk`, K = the largest
  top-k asked, at least CANDIDATES): the top-k set always lies there, and a top-p nucleus does
  unless the K candidates hold less than top_p of the mass; such rows (very flat distributions)
  are sorted whole, so the result stays exact.
- Ties at the top-k boundary: the per-row path keeps every token equal to the k-th largest
  logit, this path exactly k of them (exact float ties only).

A request with a seed draws its uniform from its own generator, so its tokens do not depend on
the batch; the others share one generator and one draw for all of them.
"""

from __future__ import annotations

import torch

CANDIDATES = 256  # tokens considered for top-p rows before falling back to the whole sorted row


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index per row drawn with probability weights / sum (weights >= 0, at least one > 0 per row);
    uniforms in (0, 1]. A zero-weight index is never returned. Overwrites `weights` (its cumsum)."""
    cdf = torch.cumsum(weights, dim=-1, out=weights)
    targets = uniforms[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets).clamp_(max=weights.shape[-1] - 1)[:, 0]


def sample_rows(logits: torch.Tensor, params: list, uniforms: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32 (rows to sample, not greedy; overwritten: every step works in place, as
    a fresh [R, V] tensor per op costs page faults that outweigh the math), params: their
    SamplingParams, uniforms [R] in (0, 1]. Returns token ids [R]."""
    rows, vocab = logits.shape
    device = logits.device
    temps = [p.temperature for p in params]
    x = logits
    if any(t != 1.0 for t in temps):
        x.div_(torch.tensor(temps, dtype=x.dtype, device=device)[:, None])
    # NaN -> -inf and +-inf clamped finite (as filtered_probs does), so exp never yields NaN
    torch.nan_to_num_(x, nan=float("-inf"))
    big = torch.finfo(x.dtype).max / 4
    x.clamp_(-big, big)
    tokens = torch.zeros(rows, dtype=torch.long, device=device)
    filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    chosen = set(filtered)
    whole = [i for i in range(rows) if i not in chosen]

    def subset(members: list[int]) -> tuple[torch.Tensor | slice, torch.Tensor]:
        if len(members) == rows:  # no copy when every row takes this path
            return slice(None), x
        index = torch.tensor(members, device=device)
        return index, x[index]

    def min_p_of(members: list[int]) -> torch.Tensor | None:
        if not any(params[i].min_p > 0 for i in members):
            return None
        return torch.tensor([params[i].min_p for i in members], dtype=x.dtype, device=device)[:, None]

    if whole:
        idx, w = subset(whole)
        w.sub_(w.amax(dim=-1, keepdim=True)).exp_()  # probabilities up to a factor: the max is 1
        min_p = min_p_of(whole)
        if min_p is not None:  # p < min_p * max p
            w.mul_(w >= min_p)
        tokens[idx] = _inverse_cdf(w, uniforms[idx])
    if filtered:
        idx, xs = subset(filtered)
        ks = [params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in filtered]
        k_cand = min(vocab, max(CANDIDATES, *ks))
        values, ids = xs.topk(k_cand, dim=-1)  # sorted, largest first
        positions = torch.arange(k_cand, device=device)[None, :]
        keep_k = torch.tensor([k or k_cand for k in ks], device=device)[:, None]
        has_k = torch.tensor([bool(k) for k in ks], device=device)
        values.masked_fill_(positions >= keep_k, float("-inf"))
        # weights relative to the row's max (values[:, 0]); normalized by the kept top-k's sum where
        # a row has top-k, else by the whole row's
        probs = (values - values[:, :1]).exp_()
        min_p = min_p_of(filtered)
        if min_p is not None:
            probs.mul_(probs >= min_p)
        kept = probs.sum(dim=-1)
        if all(ks):
            total = kept
        else:
            full = xs.sub_(values[:, :1]).exp_()  # xs is not needed past here
            if min_p is not None:
                full.mul_(full >= min_p)
            total = torch.where(has_k, kept, full.sum(dim=-1))
        top_p = torch.tensor([params[i].top_p for i in filtered], dtype=probs.dtype, device=device)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely candidates
        drop = before >= (top_p * total)[:, None]
        drop[:, 0] = False  # the top token always stays (a top_p that underflows float32)
        # a nucleus that may extend past the candidates: the last candidate is kept while there is
        # mass outside them
        unsure = (total - kept > 0) & ~drop[:, -1] & ~has_k
        probs.masked_fill_(drop, 0.0)
        choice = ids.gather(1, _inverse_cdf(probs, uniforms[idx])[:, None])[:, 0]
        wide = unsure.nonzero()[:, 0]
        if len(wide):  # the nucleus is wider than the candidates: sort these rows whole
            choice[wide] = _nucleus(full[wide], top_p[wide], uniforms[idx][wide])
        tokens[idx] = choice
    return tokens


def _nucleus(weights: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Top-p over whole rows of weights (probabilities up to a factor per row), as filtered_probs."""
    ordered, order = weights.sort(dim=-1, descending=True)
    cumulative = ordered.cumsum(dim=-1)
    drop = (cumulative - ordered) >= (top_p * cumulative[:, -1])[:, None]
    drop[:, 0] = False
    ordered.masked_fill_(drop, 0.0)
    return order.gather(1, _inverse_cdf(ordered, uniforms)[:, None])[:, 0]
