"""Proposes each running request's draft tokens before the scheduler runs (pure Python)."""

from __future__ import annotations

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


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` of every running request (empty where it does not draft this step)."""
        cfg = self.config
        allowed = len(running) <= cfg.disable_by_batch_size
        for request in running:
            request.spec_token_ids = []
            # only a request that is decoding (its prompt is done) drafts
            if not allowed or request.num_computed_tokens != request.num_tokens - 1 or not can_speculate(request):
                continue
            if request.spec is None:
                request.spec = SpecState(NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max))
            if not request.spec.ready():
                continue
            # drafts past max_tokens or the context window could never be emitted
            limit = min(cfg.num_speculative_tokens, request.params.max_tokens - request.num_output_tokens - 1,
                        self.max_model_len - request.num_tokens)
            if limit <= 0:
                continue
            request.spec.index.extend(request.prompt_token_ids, request.output_token_ids)
            request.spec_token_ids = request.spec.index.propose(limit)
