"""Runs one engine step on the model: builds the ragged batch (decode rows first, then
prompt chunks, no padding), the attention metadata from block tables, one forward,
logits for the rows that sample, and the sampler."""

from __future__ import annotations

import numpy as np
import torch

from brisk.engine.attention import AttentionMetadata, PagedKVCache, PrefillSeq, TorchPagedAttention
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
        self.sampler = Sampler(loaded.device, seed, loaded.tokenizer.eos_token_ids)

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Slots of positions start..end-1 (the step's new tokens: O(new tokens))."""
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _context_slots(self, tables: list[list[int]], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Slots of positions 0..length-1 of each row, flat [rows * max(lengths)], expanded from the
        block tables by tensor ops (Python touches one int per block, not per token); padding
        points at slot 0 (finite, never a sequence's) and the mask [rows, 1, 1, width] marks what is
        real (None when no row is padded)."""
        bs = self.block_size
        width = max(lengths)
        nb = -(-width // bs)
        table = torch.from_numpy(np.array([t[:nb] if len(t) >= nb else t + [0] * (nb - len(t)) for t in tables],
                                          dtype=np.int64))
        slots = (table[:, :, None] * bs + torch.arange(bs)).view(len(tables), nb * bs)[:, :width]
        mask = None
        if min(lengths) < width:
            valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
            slots = slots.masked_fill(~valid, 0)
            mask = valid[:, None, None, :].to(self.device)
        return slots.reshape(-1).to(self.device), mask

    def _prepare(self, chunks: list[ScheduledChunk]):
        chunks = sorted(chunks, key=lambda c: c.num_tokens > 1)  # decodes first, order kept otherwise
        input_ids, positions, slot_mapping = [], [], []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefills: list[PrefillSeq] = []
        sample_rows, sample_requests = [], []
        for chunk in chunks:
            req = chunk.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            row = len(input_ids)
            input_ids += _tokens(req, start, end)
            positions += range(start, end)
            slot_mapping += self._slots(chunk.block_ids, start, end)
            if chunk.num_tokens == 1:
                decode_tables.append(chunk.block_ids)
                decode_lengths.append(end)
            else:
                context, _ = self._context_slots([chunk.block_ids], [end])
                prefills.append(PrefillSeq(row, chunk.num_tokens, context, start))
            if end == req.num_tokens:  # the last known token: its logits give the next one
                sample_rows.append(row + chunk.num_tokens - 1)
                sample_requests.append(req)
        dev = self.device
        decode_slot_t = decode_mask = None
        if decode_tables:
            decode_slot_t, decode_mask = self._context_slots(decode_tables, decode_lengths)
        meta = AttentionMetadata(torch.tensor(slot_mapping, device=dev), len(decode_tables), decode_slot_t,
                                 decode_mask, prefills)
        return (torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), meta,
                sample_rows, sample_requests)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[list[Request], SamplerOutput | None]:
        """One forward over all chunks; returns the requests that sampled and their samples."""
        input_ids, positions, meta, sample_rows, sample_requests = self._prepare(chunks)
        attention = TorchPagedAttention(self.kv, meta, self.scale)
        hidden = self.model(input_ids, positions, attention)
        if not sample_requests:
            return [], None
        logits = self.model.compute_logits(hidden[sample_rows])
        return sample_requests, self.sampler(logits, sample_requests)


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """Tokens start..end-1 of prompt + output, without concatenating the whole sequence."""
    prompt = req.prompt_token_ids
    p = len(prompt)
    if start >= p:
        return req.output_token_ids[start - p:end - p]
    if end <= p:
        return prompt[start:end]
    return prompt[start:] + req.output_token_ids[:end - p]
