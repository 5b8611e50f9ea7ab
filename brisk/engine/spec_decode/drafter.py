"""Who drafts this step and how many tokens (pure Python), and the n-gram proposer's step.

A proposer has two calls per engine step: `propose(running)` before the scheduler (sets each
request's `spec_token_ids`; the scheduler only counts them against its budget and memory) and
`draft(chunks)` after it (a draft model fills the tokens in then, once their KV slots exist)."""

from __future__ import annotations

from typing import Iterator

from brisk.engine.request import Request
from brisk.engine.spec_decode.config import SpeculativeConfig
from brisk.engine.spec_decode.ngram import NgramIndex
from brisk.engine.spec_decode.policy import SpecState


def can_speculate(request: Request) -> bool:
    """Requests whose next-token distribution does not depend on where in the draft it is taken:
    penalties count the output so far and a grammar advances per token, so those requests decode
    one token per step."""
    p = request.params
    return p.speculative and not p.needs_penalties and request.grammar is None


def drafting(running: list[Request], config: SpeculativeConfig, max_model_len: int) -> Iterator[tuple[Request, int]]:
    """(request, most tokens it may draft) for each running request that drafts this step; every
    running request's `spec_token_ids` is cleared first."""
    allowed = len(running) <= config.disable_by_batch_size
    for request in running:
        request.spec_token_ids = []
        # only a request that is decoding (its prompt is done) drafts
        if not allowed or request.num_computed_tokens != request.num_tokens - 1 or not can_speculate(request):
            continue
        if request.spec is None:
            request.spec = SpecState()
        if not request.spec.ready():
            continue
        # drafts past max_tokens or the context window could never be emitted
        limit = min(config.num_speculative_tokens, request.params.max_tokens - request.num_output_tokens - 1,
                    max_model_len - request.num_tokens)
        if limit > 0:
            yield request, limit


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, running: list[Request]) -> list[tuple[Request, Exception]]:
        """Each drafting request's proposal; returns the requests whose proposing raised, with the error
        (the engine ends them; the others draft as usual)."""
        cfg = self.config
        failed = []
        for request, limit in drafting(running, cfg, self.max_model_len):
            try:
                state = request.spec
                if state.index is None:
                    state.index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                state.index.extend(request.all_token_ids)
                request.spec_token_ids = state.index.propose(limit)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                request.spec_token_ids = []
                failed.append((request, e))
        return failed

    def draft(self, chunks) -> None:
        """Nothing to do after scheduling: the n-gram proposals are the tokens."""
