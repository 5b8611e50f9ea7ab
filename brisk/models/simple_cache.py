"""A contiguous KV cache for one sequence: the simple path used by `brisk generate`
and the reference tests. The paged engine replaces it for serving."""

from __future__ import annotations

import torch

from brisk.config import ModelConfig
from brisk.models.layers import attend


class SingleSequenceCache:
    """K/V for one sequence in preallocated [num_layers, max_len, num_kv_heads, head_dim] tensors.

    Call `begin(num_new_tokens)` before a forward and `commit()` after it; the
    object is then passed to the model as its `attention`.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device):
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_cached = 0
        self.num_new = 0
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap
        self.layer_windows = cfg.layer_windows

    def begin(self, num_new_tokens: int) -> None:
        if self.num_cached + num_new_tokens > self.max_len:
            raise ValueError(
                f"sequence of {self.num_cached + num_new_tokens} tokens exceeds the cache of {self.max_len}"
            )
        self.num_new = num_new_tokens

    def commit(self) -> None:
        self.num_cached += self.num_new
        self.num_new = 0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        start, end = self.num_cached, self.num_cached + self.num_new
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        keys = self.k[layer, :end].transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, S, head_dim]
        values = self.v[layer, :end].transpose(0, 1).unsqueeze(0)
        query = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, T, head_dim]
        window = self.layer_windows[layer] if self.layer_windows else None
        mask = None
        if (self.num_new > 1 and start > 0) or window is not None:
            rows = torch.arange(start, end, device=q.device)[:, None]
            context = torch.arange(end, device=q.device)[None, :]
            mask = context <= rows  # [T, S]
            if window is not None:  # sliding window: position i sees i - window + 1 .. i
                mask &= context > rows - window
        out = attend(query, keys, values, mask, mask is None and self.num_new > 1, self.scale,
                     self.softcap, sinks)  # [1, num_heads, T, head_dim]
        return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)
