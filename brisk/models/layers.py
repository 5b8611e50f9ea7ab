"""Building blocks of the decoder: RMSNorm, rotary embeddings, and attention's math.

RoPE frequencies follow Hugging Face's definitions for every scaling type found in
HF configs (`default`, `linear`, `dynamic`, `llama3`, `yarn`), computed in float32
the same way so that logits agree with the reference.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from brisk.config import ModelConfig, RopeConfig
from brisk.kernels import fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with `residual`: residual += x in place, then norm(residual) (one pass)."""
        return fused.rms_norm(x, self.weight, self.eps, residual)


def rotary_dim(cfg: ModelConfig, rope: RopeConfig | None = None) -> int:
    return int(cfg.head_dim * (rope or cfg.rope).partial_rotary_factor)


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta ** exponents)


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None, rope: RopeConfig | None = None
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] and the cos/sin scaling factor.

    `seq_len` matters only for `dynamic` (NTK) scaling, whose base grows with the
    longest sequence served; brisk passes `max_model_len` so that every cached K
    was rotated with the same frequencies (HF recomputes them per forward instead).
    A GGUF's frequency factors divide the result, as llama.cpp applies them. `rope`: the layer's
    own RoPE where it is not the model's (Gemma 3's sliding layers).
    """
    rope = rope or cfg.rope
    inv_freq, scaling = _typed_inv_freq(cfg, rope, seq_len)
    factors = rope.freq_factors
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, scaling


def _typed_inv_freq(cfg: ModelConfig, rope: RopeConfig, seq_len: int | None) -> tuple[torch.Tensor, float]:
    dim = rotary_dim(cfg, rope)
    if rope.rope_type == "default":
        return _base_inv_freq(rope.theta, dim), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        max_pos = cfg.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        base = rope.theta * ((rope.factor * seq_len / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(rope, dim, seq_len)
    raise ValueError(f"unknown rope_type {rope.rope_type!r}")  # ModelConfig validated it


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_len = rope.get("original_max_position_embeddings")
    low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor, base = rope.factor, rope.theta
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1
    orig_len = rope.get("original_max_position_embeddings")

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(rope: RopeConfig, dim: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency factors, the long ones when the served context exceeds the
    pretrained one. brisk decides once, for `max_model_len` (as llama.cpp does for its context size):
    every cached K then uses the same frequencies; transformers decides per forward, by its length."""
    original = rope.get("original_max_position_embeddings")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if rope.factor <= 1.0 else math.sqrt(1 + math.log(rope.factor) / math.log(original))
    factors = rope.get("long_factor") if seq_len and seq_len > original else rope.get("short_factor")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** exponents), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half layout)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str | None = None,
                 rope: RopeConfig | None = None):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(cfg, seq_len=max_positions, rope=rope)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim // 2]
        self.rotary_dim = rotary_dim(cfg, rope)
        self.register_buffer("cos", (freqs.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).to(device), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeTables":
        """cos/sin rows for these positions, looked up once per forward and shared by all layers."""
        return RopeTables(self.cos[positions].to(dtype), self.sin[positions].to(dtype), self.rotary_dim)


class RopeTables(NamedTuple):
    cos: torch.Tensor  # [T, rotary_dim // 2]
    sin: torch.Tensor
    rotary_dim: int

    def rotate_(self, x: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotate in place the first `heads` heads of each row of x [T, width] (q and k heads side
        by side in the fused qkv projection rotate in one pass)."""
        fused.rope_(x, heads, head_dim, self.cos, self.sin, self.rotary_dim)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool, scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, heads, L, D], keys/values [B, kv_heads, S, D] (GQA) -> [B, heads, L, D].

    SDPA, except with Gemma 2's soft-capping (scores -> cap * tanh(scores / cap) before the
    softmax) or gpt-oss's sinks (a logit per head joins the softmax, with no value), which SDPA
    cannot express: then the eager math, as transformers runs those models."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        length, span = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(length, span, dtype=torch.bool, device=scores.device).tril(span - length)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        return torch.matmul(weights, values)
    scores = scores.float()
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    weights = torch.softmax(combined, dim=-1)[..., :-1].to(values.dtype)
    return torch.matmul(weights, values)
