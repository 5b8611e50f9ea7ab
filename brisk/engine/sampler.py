"""Sampling on the model's device: penalties, greedy/temperature/top-k/top-p/min-p,
per-request seeds, and logprobs. One host transfer per step (the caller's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.engine.request import Request
from brisk.engine.sample_rows import sample_rows
from brisk.engine.spec_decode.verify import verify_greedy, verify_sampled
from brisk.structured.bitmask import GrammarMasker

MIN_LOGPROB = -9999.0


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [rows]: one row per request, or 1 + its draft length with drafts
    logprobs: torch.Tensor | None  # [rows] logprob of the row's token
    top_ids: torch.Tensor | None  # [rows, k]
    top_logprobs: torch.Tensor | None  # [rows, k]
    # With drafts: rows per request and how many of them hold emitted tokens (accepted drafts and
    # the target's own next token); None when every request has one row and emits it.
    num_rows: list[int] | None = None
    num_emitted: list[int] | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids: tuple[int, ...] = ()):
        self.device = device
        self.masker = GrammarMasker(eos_token_ids)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def generator_of(self, request: Request) -> torch.Generator:
        """The request's own generator (seeded requests) or the shared one."""
        if request.params.seed is None:
            return self.generator
        gen = self.request_generators.get(request.request_id)
        if gen is None:  # seeded once per request: same seed, same draws, whatever the batch
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.params.seed)
            self.request_generators[request.request_id] = gen
        return gen

    def random_states(self, requests: list[Request]) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The states of the generators these requests draw from (none for an all-greedy step), so that a
        step sampled again request by request (after a failure) draws what it would have drawn."""
        if all(r.params.greedy for r in requests):
            return []
        generators = {id(g): g for g in [self.generator] + [self.generator_of(r) for r in requests
                                                              if r.params.seed is not None]}
        return [(g, g.get_state()) for g in generators.values()]

    @staticmethod
    def restore_random_states(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for generator, state in states:
            generator.set_state(state)

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 drafts: list[list[int]] | None = None) -> SamplerOutput:
        """logits: [rows, vocab] float32. Without drafts row i is requests[i]'s next token; with
        drafts, request i has 1 + len(drafts[i]) consecutive rows (its last token's and each
        drafted token's logits), verified here (spec_decode.verify)."""
        num_rows = [1 + len(d) for d in drafts] if drafts else None
        row_requests = requests if drafts is None else [r for r, n in zip(requests, num_rows) for _ in range(n)]
        # penalties: never with a draft (spec_decode.drafter.can_speculate)
        penalized = [i for i, r in enumerate(row_requests) if r.params.needs_penalties]
        if penalized:
            apply_penalties(logits, penalized, [row_requests[i] for i in penalized])
        biased = [i for i, r in enumerate(row_requests) if r.params.logit_bias]
        if biased:
            apply_logit_bias(logits, biased, [row_requests[i].params.logit_bias for i in biased])
        constrained = [i for i, r in enumerate(row_requests) if r.grammar is not None]
        if constrained:  # only these rows pay for a mask; the others' logits are untouched
            self.masker.apply(logits, constrained, [row_requests[i].grammar for i in constrained])
        num_top = max((r.params.logprobs for r in requests if r.params.logprobs is not None), default=None)
        logprobs_all = torch.log_softmax(logits, dim=-1) if num_top is not None else None
        greedy = [i for i, r in enumerate(row_requests) if r.params.greedy]
        if len(greedy) == len(row_requests):  # all greedy: no copy of the [rows, vocab] logits
            token_ids = logits.argmax(dim=-1)
        else:
            # zeros, not empty: a sampled request's rows past its emitted tokens stay unset and
            # must still be valid ids for the logprobs gather below
            token_ids = torch.zeros(len(row_requests), dtype=torch.long, device=logits.device)
            if greedy:
                token_ids[greedy] = logits[greedy].argmax(dim=-1)
        num_emitted = None
        if drafts is None:
            sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
            if sampled:
                self._sample(logits, token_ids, [requests[i] for i in sampled], sampled)
        else:
            num_emitted = self._verify(logits, token_ids, requests, drafts)
        out = SamplerOutput(token_ids, None, None, None, num_rows, num_emitted)
        if logprobs_all is not None:
            # floored like OpenAI/vLLM: a token the model all but rules out reports -9999, not -1e30
            logprobs_all.clamp_(min=MIN_LOGPROB)
            out.logprobs = logprobs_all.gather(1, token_ids[:, None])[:, 0]
            out.top_logprobs, out.top_ids = logprobs_all.topk(max(num_top, 1), dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, token_ids: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        """Sample `rows` (not greedy) together (brisk.engine.sample_rows): one uniform per row, from
        the request's own generator when it has a seed, else one draw for all from the shared one."""
        uniforms = torch.empty(len(rows), device=logits.device)
        shared = [j for j, r in enumerate(requests) if r.params.seed is None]
        if shared:
            uniforms[shared] = torch.rand(len(shared), generator=self.generator, device=logits.device)
        for j, request in enumerate(requests):
            if request.params.seed is not None:
                uniforms[j] = torch.rand(1, generator=self.generator_of(request), device=logits.device)[0]
        index = torch.tensor(rows, device=logits.device) if len(rows) < logits.shape[0] else None
        # sample_rows works in place: on the logits themselves when every row samples (nothing reads
        # them after this step), else on a copy of the sampled rows
        chosen = logits if index is None else logits[index]
        tokens = sample_rows(chosen, [r.params for r in requests], 1.0 - uniforms)
        token_ids[slice(None) if index is None else index] = tokens

    def _verify(self, logits: torch.Tensor, token_ids: torch.Tensor, requests: list[Request],
                drafts: list[list[int]]) -> list[int]:
        """Write each request's emitted tokens into its first rows; returns how many it emits."""
        greedy_ids = token_ids.tolist() if any(r.params.greedy and d for r, d in zip(requests, drafts)) else None
        num_emitted, row = [], 0
        for request, draft in zip(requests, drafts):
            rows = slice(row, row + 1 + len(draft))
            if request.params.greedy:
                n = verify_greedy(greedy_ids[rows], draft) if draft else 1
            else:
                probs = torch.stack([filtered_probs(r, request) for r in logits[rows]])
                # a draft model's own distributions; None for the n-gram proposer (a point mass)
                draft_probs = request.spec.draft_probs if draft and request.spec is not None else None
                emitted = verify_sampled(probs, draft, self.generator_of(request), draft_probs)
                token_ids[row:row + len(emitted)] = torch.tensor(emitted, device=token_ids.device)
                n = len(emitted)
            num_emitted.append(n)
            row += 1 + len(draft)
        return num_emitted


def _flat(rows: list[int], id_lists: list, vocab: int, device) -> torch.Tensor:
    """Positions row * vocab + id in the flattened [rows, vocab] logits, for every id of each row."""
    flat = [row * vocab + t for row, ids in zip(rows, id_lists) for t in ids]
    return torch.tensor(flat, dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
    """In place on `rows` of logits [R, V] (contiguous), all rows at once. Repetition (HF/CTRL
    semantics) over prompt and output: a seen token's logit is divided by the penalty if positive,
    else multiplied.
    Presence/frequency (OpenAI semantics) over the output: minus frequency x count + presence."""
    vocab = logits.shape[1]
    device = logits.device
    flat_logits = logits.view(-1)
    repeat = [(row, r) for row, r in zip(rows, requests) if r.params.repetition_penalty != 1.0]
    if repeat:
        seen = _flat([row for row, _ in repeat], [set(r.all_token_ids) for _, r in repeat], vocab, device)
        penalty = torch.tensor([r.params.repetition_penalty for _, r in repeat], dtype=logits.dtype, device=device)
        per_id = penalty.repeat_interleave(torch.tensor([len(set(r.all_token_ids)) for _, r in repeat],
                                                        device=device))
        values = flat_logits[seen]
        flat_logits[seen] = torch.where(values > 0, values / per_id, values * per_id)
    counted = [(row, r) for row, r in zip(rows, requests)
               if (r.params.presence_penalty or r.params.frequency_penalty) and r.num_output_tokens]
    if counted:
        ids = _flat([row for row, _ in counted], [r.output_tokens_from(0) for _, r in counted], vocab, device)
        unique, counts = ids.unique(return_counts=True)
        row_of = unique // vocab
        frequency = torch.zeros(logits.shape[0], dtype=logits.dtype, device=device)
        presence = torch.zeros_like(frequency)
        for row, r in counted:
            frequency[row], presence[row] = r.params.frequency_penalty, r.params.presence_penalty
        flat_logits[unique] -= frequency[row_of] * counts.to(logits.dtype) + presence[row_of]
    # a repetition penalty near 0 divides logits into +-inf (and inf - inf is NaN): keep the rows
    # finite so argmax, log_softmax and the JSON of logprobs stay well defined
    index = torch.tensor(rows, device=device)
    big = torch.finfo(logits.dtype).max / 4
    logits[index] = logits[index].nan_to_num_(nan=-big, posinf=big, neginf=-big)


def apply_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[dict[int, float]]) -> None:
    """In place: each row's {token id: bias} added to its logits."""
    ids = _flat(rows, [list(b) for b in biases], logits.shape[1], logits.device)
    values = torch.tensor([v for b in biases for v in b.values()], dtype=logits.dtype, device=logits.device)
    logits.view(-1).index_add_(0, ids, values)


def filtered_probs(row: torch.Tensor, request: Request) -> torch.Tensor:
    p = request.params
    # NOTE: extreme but valid settings (a repetition penalty near 0, a temperature near the greedy
    # cut-off) can push logits to +-inf; keep them finite so softmax never yields NaN.
    logits = torch.nan_to_num(row / p.temperature, nan=float("-inf"))
    big = torch.finfo(logits.dtype).max / 4
    logits = logits.clamp(-big, big)
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (cumulative - sorted_probs) >= p.top_p * cumulative[-1]
        drop[0] = False  # a top_p that underflows float32 (1e-300) would otherwise drop every token
        probs = probs.scatter(0, order[drop], 0.0)
    return probs
