"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2).

The model computes over a flat batch of tokens: `input_ids` [T] and `positions` [T]
may hold several sequences back to back. How K/V are stored and attended is up to
the `attention` object passed to `forward` (a contiguous cache for one sequence
here, paged block tables in the engine), so the model holds no cache state.

Parameter names follow HF's, except two fused projections:
`self_attn.qkv_proj` (q, k, v stacked on the output dim) and `mlp.gate_up_proj`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from brisk.config import ModelConfig
from brisk.kernels import fused
from brisk.models.layers import RMSNorm, RopeTables, RotaryEmbedding
from brisk.models.linear import Linear


class Attention(Protocol):
    """Stores this step's K/V for `layer` and returns attention output [T, num_heads * head_dim]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, rope: RopeTables, attention: Attention):
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        # q and k heads are adjacent in qkv: rotate them together, in place
        rope.rotate_(qkv, self.num_heads + self.num_kv_heads, self.head_dim)
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attention(self.layer_idx, q, k, v)  # [T, num_heads * head_dim]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, attention, next_norm: RMSNorm):
        """x: this layer's normalized input; residual: the stream, updated in place. Returns
        `next_norm` (the next layer's input norm, or the final norm) of the updated stream."""
        x = self.post_attention_layernorm(self.self_attn(x, rope, attention), residual)
        return next_norm(self.mlp(x), residual)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # NOTE: `_weight` skips the random init: on the meta device `normal_` would import
        # torch._dynamo (3.5 s of a cold start) to initialise values that are replaced anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Build on the `meta` device, then `load_weights` assigns the real tensors."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def load_weights(self, state_dict: dict[str, torch.Tensor], max_positions: int, device) -> None:
        """Assign checkpoint tensors as parameters (no copy) and build the RoPE tables."""
        if self.config.tie_word_embeddings:  # the head reads the embedding's tensors (float or quantized)
            embed = "model.embed_tokens."
            state_dict = {**state_dict, **{"lm_head." + n[len(embed):]: t for n, t in state_dict.items()
                                           if n.startswith(embed)}}
        self.load_state_dict(state_dict, strict=True, assign=True)
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(self.config, max_positions, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden_size]."""
        residual = self.model.embed_tokens(input_ids)  # the residual stream, added to in place
        rope = self.rotary.tables(positions, residual.dtype)
        stack = getattr(attention, "decode_stack", None)
        if stack is not None:  # a decode-only step: every layer in one compiled call, same results
            return stack(residual, rope)
        layers = self.model.layers
        x = layers[0].input_layernorm(residual)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x = layer(x, residual, rope, attention, next_norm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] in float32."""
        return self.lm_head(hidden).float()
