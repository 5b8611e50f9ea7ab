"""Runs one engine step on the model: builds the ragged batch (decode rows first, then
prompt chunks, no padding), the attention metadata from block tables, one forward,
logits for the rows that sample, and the sampler."""

from __future__ import annotations

import torch

from brisk.engine.attention import (AttentionMetadata, PagedKVCache, PrefillSeq, attention_backend, block_tables,
                                    context_slots)
from brisk.engine.request import Request
from brisk.engine.sampler import Sampler, SamplerOutput
from brisk.engine.scheduler import ScheduledChunk
from brisk.loading.loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, seed: int = 0):
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.kv = PagedKVCache(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim,
                               loaded.dtype, loaded.device)
        self.scale = cfg.head_dim ** -0.5
        self.attention = attention_backend(torch.device(loaded.device), loaded.dtype)
        self.sampler = Sampler(loaded.device, seed, loaded.tokenizer.eos_token_ids)

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Slots of positions start..end-1 (the step's new tokens: O(new tokens))."""
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, chunks: list[ScheduledChunk]):
        # decodes (with their drafts) first, order kept otherwise
        chunks = sorted(chunks, key=lambda c: c.num_tokens - c.num_draft > 1)
        input_ids, positions, slot_mapping = [], [], []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefills: list[PrefillSeq] = []
        sample_rows, sample_requests, drafts = [], [], []
        for chunk in chunks:
            req = chunk.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            row = len(input_ids)
            draft = req.spec_token_ids[:chunk.num_draft]
            input_ids += _tokens(req, start, end - chunk.num_draft) + draft
            positions += range(start, end)
            slot_mapping += self._slots(chunk.block_ids, start, end)
            if chunk.num_tokens - chunk.num_draft == 1:
                # a decode, and each drafted token as a decode row of its own that sees the
                # positions before it: every row attends exactly as one-token decoding would, so
                # verification reproduces its logits bit for bit
                decode_tables += [chunk.block_ids] * (1 + chunk.num_draft)
                decode_lengths += range(start + 1, end + 1)
            else:
                table = block_tables([chunk.block_ids], [end], self.block_size)
                context, _ = context_slots(table, torch.tensor([end]), self.block_size, self.device)
                prefills.append(PrefillSeq(row, chunk.num_tokens, context, start))
            if end - chunk.num_draft == req.num_tokens:  # the last known token: its logits give the next one
                # (and with a draft, each drafted position's logits verify the next draft token)
                sample_rows += range(row + chunk.num_tokens - 1 - chunk.num_draft, row + chunk.num_tokens)
                sample_requests.append(req)
                drafts.append(draft)
        dev = self.device
        tables = lens = None
        if decode_tables:
            tables = block_tables(decode_tables, decode_lengths, self.block_size)
            lens = torch.tensor(decode_lengths, dtype=torch.int32)
        meta = AttentionMetadata(torch.tensor(slot_mapping, device=dev), self.block_size, tables, lens, prefills,
                                 self.loaded.config.layer_windows)
        return (torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), meta,
                sample_rows, sample_requests, drafts)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[list[Request], SamplerOutput | None]:
        """One forward over all chunks; returns the requests that sampled and their samples (with
        drafted tokens: the tokens each request emits after verification)."""
        input_ids, positions, meta, sample_rows, sample_requests, drafts = self._prepare(chunks)
        attention = self.attention(self.kv, meta, self.scale)
        hidden = self.model(input_ids, positions, attention)
        if not sample_requests:
            return [], None
        logits = self.model.compute_logits(hidden[sample_rows])
        return sample_requests, self.sampler(logits, sample_requests, drafts if any(drafts) else None)


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """Tokens start..end-1 of prompt + output, without concatenating the whole sequence."""
    prompt = req.prompt_token_ids
    p = len(prompt)
    if start >= p:
        return req.output_token_ids[start - p:end - p]
    if end <= p:
        return prompt[start:end]
    return prompt[start:] + req.output_token_ids[:end - p]
