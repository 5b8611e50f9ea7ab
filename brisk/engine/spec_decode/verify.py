"""Verifying drafted tokens against the target model's distributions.

Greedy requests accept the longest prefix of the draft that equals the target's argmax at each
position, then emit the target's own token where they part (or after the last draft token): the
output is exactly what one-token-per-step greedy decoding gives.

Sampled requests use rejection sampling (Leviathan et al. 2023; Chen et al. 2023). The n-gram
proposer is deterministic: its draft distribution q is a point mass on the drafted token d. Token
d is accepted with probability min(1, p(d) / q(d)) = p(d); on rejection the emitted token is drawn
from the residual max(0, p - q) renormalised, which is p with d removed. So each emitted token is x
with probability p(d)·[x = d] + (1 - p(d))·p(x)/(1 - p(d))·[x ≠ d] = p(x): the target's own
(temperature, top-k, top-p, min-p filtered) distribution, exactly. After k accepted drafts the
target's distribution at the last row gives one more token. A draft model samples d from its own
distribution q: d is accepted with probability min(1, p(d) / q(d)), and a rejection draws from
max(0, p - q) renormalised, which again emits each token with probability p(x).
"""

from __future__ import annotations

import torch


def verify_greedy(target_ids: list[int], draft: list[int]) -> int:
    """target_ids: the target's argmax at the k + 1 rows. Returns the tokens emitted (accepted
    drafts + 1); they are target_ids[:n]."""
    n = 0
    while n < len(draft) and draft[n] == target_ids[n]:
        n += 1
    return n + 1


def verify_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    """probs: [k + 1, vocab] the target's filtered distributions at each row; draft_probs: [k, vocab]
    the distributions the draft tokens were sampled from (None: the proposer was deterministic, a
    point mass on each drafted token). Returns the emitted tokens (accepted drafts, then one token
    drawn from the residual or from the last row)."""
    emitted = []
    for i, token in enumerate(draft):
        p = probs[i]
        q_token = 1.0 if draft_probs is None else draft_probs[i, token]
        # accept with probability min(1, p(d) / q(d)) (u < p/q, i.e. u * q < p, with u in [0, 1))
        if torch.rand((), generator=generator, device=p.device) * q_token < p[token]:
            emitted.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0  # p(token) < 1 here: a uniform draw in [0, 1) accepts a certain token
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q (to rounding): nothing to correct
                residual = p
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)[0]))
        return emitted
    emitted.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)[0]))
    return emitted
