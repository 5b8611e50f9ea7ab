"""Draft-model speculation: a smaller model with the target's vocabulary, in the same process,
with its own paged KV cache, proposes k tokens that the target verifies in one forward.

The draft's cache has as many slots as the target's and uses the same block ids: a token's draft
K/V lives at the slot where the target keeps its K/V, so the draft needs no block manager of its
own; the target's allocation (which includes the drafted positions) covers both. Each request
remembers how many of its positions the draft cache holds (`SpecState.draft_computed`); a draft
step first catches up (its prompt the first time, one token after an all-accepted round), then
runs k - 1 one-token steps. Rejected positions are simply forgotten (the target truncates their
slots), and a preempted request starts over. Shared prefix blocks are recomputed by the draft
(another request's draft may never have filled them): the draft writes the same tokens' K/V there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from brisk.engine.attention import PagedKVCache, attention_backend
from brisk.engine.model_runner import SeqSlice, build_batch, sequence_tokens
from brisk.engine.request import Request
from brisk.engine.sampler import filtered_probs
from brisk.engine.scheduler import ScheduledChunk
from brisk.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from brisk.engine.spec_decode.drafter import drafting
from brisk.kv_dtype import KVDtype


def approx_parameters(cfg) -> int:
    """Parameters of a llama-family model from its config (embeddings, head, attention, MLP)."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + head + cfg.num_layers * per_layer


def check_draft(target, draft, name: str) -> None:
    """A draft brisk can verify: the same vocabulary (token for token), smaller than the target."""
    t_vocab = target.tokenizer.fast.get_vocab(with_added_tokens=True)
    d_vocab = draft.tokenizer.fast.get_vocab(with_added_tokens=True)
    if draft.config.vocab_size != target.config.vocab_size or t_vocab != d_vocab:
        differ = sum(1 for tok, i in d_vocab.items() if t_vocab.get(tok) != i) + abs(len(t_vocab) - len(d_vocab))
        raise SpeculativeConfigError(
            f"--speculative-config model {name}: its vocabulary differs from the target's (vocab_size "
            f"{draft.config.vocab_size} vs {target.config.vocab_size}, {differ} tokens differ); a draft must "
            "use the target's tokenizer")
    t_params, d_params = approx_parameters(target.config), approx_parameters(draft.config)
    if d_params >= t_params:
        raise SpeculativeConfigError(
            f"--speculative-config model {name}: the draft ({d_params / 1e6:.0f}M parameters) is not smaller than "
            f"the target ({t_params / 1e6:.0f}M); use a smaller draft or method ngram")
    if target.config.layer_windows:
        raise SpeculativeConfigError(
            f"--speculative-config model {name}: draft-model speculation with a sliding-window target is not "
            "supported (its freed blocks would be rewritten); use method ngram")


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, target, draft, num_blocks: int, block_size: int,
                 kv_dtype: KVDtype, max_model_len: int, generator_for: Callable[[Request], torch.Generator]):
        check_draft(target, draft, config.model)
        self.config = config
        self.loaded = draft
        self.model = draft.model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.generator_for = generator_for
        cfg = draft.config
        # the target's KV dtype (one dtype per pool; the budget counted the draft's K/V in it)
        self.kv = PagedKVCache(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim,
                               kv_dtype, draft.device)
        self.scale = cfg.head_dim ** -0.5
        self.attention = attention_backend(torch.device(draft.device))

    def propose(self, running: list[Request]) -> list:
        """Reserve each drafting request's k positions (placeholders the scheduler counts);
        `draft` fills them in once the scheduler has allocated their slots. Nothing here can fail one
        request alone (the draft model's forward is shared): returns no failures."""
        for request, limit in drafting(running, self.config, self.max_model_len):
            request.spec_token_ids = [0] * limit
        return []

    @torch.inference_mode()
    def draft(self, chunks: list[ScheduledChunk]) -> None:
        work = [c for c in chunks if c.num_draft > 0]
        if not work:
            return
        seqs = []
        for chunk in work:
            request, state = chunk.request, chunk.request.spec
            if state.preemptions_seen != request.num_preemptions:  # its blocks (and draft K/V) are gone
                state.draft_computed, state.preemptions_seen = 0, request.num_preemptions
            start = min(state.draft_computed, request.num_tokens - 1)
            seqs.append((chunk, start, sequence_tokens(request, start, request.num_tokens)))
        seqs.sort(key=lambda s: len(s[2]) > 1)  # one-token catch-ups first (decode rows)
        drafted: dict[int, list[int]] = {id(c): [] for c in work}
        dists: dict[int, list[torch.Tensor]] = {id(c): [] for c in work}
        slices = [SeqSlice(tokens, start, c.block_ids, len(tokens) == 1) for c, start, tokens in seqs]
        active = [c for c, _, _ in seqs]
        for step in range(max(c.num_draft for c in work)):
            batch = build_batch(slices, self.block_size, self.loaded.device, self.loaded.config.layer_windows)
            hidden = self.model(batch.input_ids, batch.positions, self.attention(self.kv, batch.meta, self.scale))
            logits = self.model.compute_logits(hidden[[end - 1 for end in batch.ends]])
            for row, chunk in enumerate(active):
                token, dist = self._pick(logits[row], chunk.request)
                drafted[id(chunk)].append(token)
                if dist is not None:
                    dists[id(chunk)].append(dist)
            active = [c for c in active if c.num_draft > step + 1]
            position = {id(c): c.request.num_tokens + step for c in active}
            slices = [SeqSlice([drafted[id(c)][-1]], position[id(c)], c.block_ids, True) for c in active]
        for chunk in work:
            request, state = chunk.request, chunk.request.spec
            request.spec_token_ids = drafted[id(chunk)]
            # K/V of the last known token and of every drafted token but the last
            state.draft_computed = request.num_tokens - 1 + chunk.num_draft
            state.draft_probs = torch.stack(dists[id(chunk)]) if dists[id(chunk)] else None

    def _pick(self, logits: torch.Tensor, request: Request) -> tuple[int, torch.Tensor | None]:
        """The draft's token: its argmax for greedy requests; a sample from its own filtered
        distribution (returned, for rejection sampling) for the others."""
        if request.params.greedy:
            return int(logits.argmax()), None
        q = filtered_probs(logits, request)
        return int(torch.multinomial(q, 1, generator=self.generator_for(request))[0]), q
