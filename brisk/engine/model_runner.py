"""Runs one engine step on the model: builds the ragged batch (decode rows first, then
prompt chunks, no padding), the attention metadata from block tables, one forward,
logits for the rows that sample, and the sampler."""

from __future__ import annotations

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
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, chunks: list[ScheduledChunk]):
        chunks = sorted(chunks, key=lambda c: c.num_tokens > 1)  # decodes first, order kept otherwise
        input_ids, positions, slot_mapping = [], [], []
        decode_slots: list[list[int]] = []
        prefills: list[PrefillSeq] = []
        sample_rows, sample_requests = [], []
        for chunk in chunks:
            req = chunk.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            row = len(input_ids)
            tokens = req.all_token_ids
            input_ids += tokens[start:end]
            positions += range(start, end)
            slot_mapping += self._slots(chunk.block_ids, start, end)
            context = self._slots(chunk.block_ids, 0, end)
            if chunk.num_tokens == 1:
                decode_slots.append(context)
            else:
                prefills.append(PrefillSeq(row, chunk.num_tokens, torch.tensor(context, device=self.device), start))
            if end == req.num_tokens:  # the last known token: its logits give the next one
                sample_rows.append(row + chunk.num_tokens - 1)
                sample_requests.append(req)
        dev = self.device
        decode_slot_t = decode_mask = None
        if decode_slots:
            lengths = [len(s) for s in decode_slots]
            width = max(lengths)
            decode_slot_t = torch.tensor([x for s in decode_slots for x in s + [0] * (width - len(s))], device=dev)
            if min(lengths) < width:  # rows of unequal length: mask the padding
                lengths_t = torch.tensor(lengths, device=dev)
                decode_mask = (torch.arange(width, device=dev)[None, :] < lengths_t[:, None])[:, None, None, :]
        meta = AttentionMetadata(torch.tensor(slot_mapping, device=dev), len(decode_slots), decode_slot_t,
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
