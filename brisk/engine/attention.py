"""Paged attention backends. K/V live in per-layer slot arrays
([num_blocks * block_size, num_kv_heads, head_dim]); each sequence reads its K/V
through its block table. This is the CPU PyTorch reference implementation; a CUDA
paged/flash kernel plugs in by implementing the same `__call__`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """A sequence computing `num_query` > 1 tokens this step (a prompt chunk)."""

    query_start: int  # row of its first new token in the flat batch
    num_query: int
    context_slots: torch.Tensor  # [context_len] slots of positions 0..context_len-1
    first_position: int  # position of its first new token (= tokens already cached)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the model runner, shared by all layers.

    The flat batch holds the decode rows first (one query each), then the prefill chunks."""

    slot_mapping: torch.Tensor  # [num_tokens] slot where each new token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes * max_context] flat (rows padded with slot 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] True where valid; None if no padding
    prefills: list[PrefillSeq]


class PagedKVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # NOTE: empty, not zeros: the OS maps pages only when a block is first written, so a
        # large pool costs nothing at start. Only slot 0 is read before being written (it pads
        # the decode batch, masked out), and it must hold finite values.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, 0].zero_()
        self.v[:, 0].zero_()


class TorchPagedAttention:
    """Callable passed to the model for one step: writes this step's K/V, then attends."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, scale: float):
        self.cache, self.meta, self.scale = cache, meta, scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            n = meta.num_decodes
            shape = (n, -1, k_cache.shape[1], k_cache.shape[2])
            # [n, num_kv_heads, max_context, head_dim]
            keys = k_cache.index_select(0, meta.decode_slots).view(shape).transpose(1, 2)
            values = v_cache.index_select(0, meta.decode_slots).view(shape).transpose(1, 2)
            query = q[:n].unsqueeze(2)  # [n, num_heads, 1, head_dim]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.decode_mask,
                                                  scale=self.scale, enable_gqa=True)
            out[:n] = attn.reshape(n, -1)
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.num_query)
            # [1, num_kv_heads, S, head_dim]
            keys = k_cache.index_select(0, seq.context_slots).transpose(0, 1).unsqueeze(0)
            values = v_cache.index_select(0, seq.context_slots).transpose(0, 1).unsqueeze(0)
            query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, num_heads, L, head_dim]
            mask = None
            if seq.first_position > 0:
                rows_pos = torch.arange(seq.first_position, seq.first_position + seq.num_query, device=q.device)
                mask = torch.arange(len(seq.context_slots), device=q.device)[None, :] <= rows_pos[:, None]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                  is_causal=seq.first_position == 0, scale=self.scale,
                                                  enable_gqa=True)
            out[rows] = attn.squeeze(0).transpose(0, 1).reshape(seq.num_query, -1)
        return out
