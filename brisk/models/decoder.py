"""The decoder every supported family runs: Llama's block, with each family's variations switched on
by its `ModelConfig` (brisk/config.py `FAMILIES`), the way llama.cpp and vLLM share one set of
layers between their model files:

- Llama 2/3.x, SmolLM2, Mistral: the plain block (RMSNorm, RoPE attention with GQA, SiLU-gated MLP);
- Qwen2: q/k/v biases; Qwen3: per-head RMSNorm of q and k before RoPE;
- Gemma: (1 + w) RMSNorm (folded into the weights at load), embeddings times sqrt(hidden), a
  GELU-tanh gate; Gemma 2: norms after attention and after the MLP too, attention and logit
  soft-capping, `query_pre_attn_scalar`, alternating sliding/global layers; Gemma 3: Gemma 2's
  block with q/k norms and a RoPE of their own for the sliding layers;
- Phi-3/3.5/4: fused qkv and gate_up as stored, LongRoPE, partial rotary dimensions;
- SmolLM3: some layers without RoPE;
- mixtures of experts (brisk.models.moe): Mixtral's Llama block, Qwen3-MoE's Qwen3 block, Qwen2-MoE's
  Qwen2 block with a shared expert, OLMoE's block with q/k norms over the whole projection, each with its
  MLP replaced by the expert layer (in every layer, or where decoder_sparse_step says).

The model computes over a flat batch of tokens: `input_ids` [T] and `positions` [T] may hold
several sequences back to back. How K/V are stored and attended is up to the `attention` object
passed to `forward` (a contiguous cache for one sequence, paged block tables in the engine), so
the model holds no cache state.

Parameter names follow HF's, except two fused projections: `self_attn.qkv_proj` (q, k, v stacked
on the output dim) and `mlp.gate_up_proj` (as Phi-3 stores them).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from brisk.config import ModelConfig
from brisk.kernels import fused
from brisk.models.layers import RMSNorm, RopeTables, RotaryEmbedding
from brisk.models.linear import Linear
from brisk.models.moe import SparseMoeBlock


class Attention(Protocol):
    """Stores this step's K/V for `layer` and returns attention output [T, num_heads * head_dim]. `sinks`
    [num_heads] (gpt-oss): a logit per head that joins each row's softmax and attends to nothing."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor: ...


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":  # one weight [head_dim] shared by every head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":  # over the whole projection (OLMoE)
            self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)

    def forward(self, x, rope: RopeTables | None, attention: Attention):
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self._normed_qk(qkv, rope)
        else:
            if rope is not None:  # q and k heads are adjacent in qkv: rotate them together, in place
                rope.rotate_(qkv, self.num_heads + self.num_kv_heads, self.head_dim)
            q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.sinks is None:
            out = attention(self.layer_idx, q, k, v)  # [T, num_heads * head_dim]
        else:
            out = attention(self.layer_idx, q, k, v, self.sinks)
        return self.o_proj(out)

    def _normed_qk(self, qkv: torch.Tensor, rope: RopeTables | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k normalized head by head (or each over its whole projection), then rotated:
        [T, heads, head_dim] each."""
        num_tokens = qkv.shape[0]
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(num_tokens * self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        else:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size)
        if rope is not None:
            rope.rotate_(q, self.num_heads, self.head_dim)
            rope.rotate_(k, self.num_kv_heads, self.head_dim)
        return (q.view(num_tokens, self.num_heads, self.head_dim),
                k.view(num_tokens, self.num_kv_heads, self.head_dim))


def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate) * up


_GATES = {"silu": fused.silu_mul, "gelu_tanh": _gelu_tanh_mul, "gelu": _gelu_mul}


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate = _GATES[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.gate(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer_idx) else DecoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Llama: the norm before the MLP. Gemma 2/3 (sandwich): the norm of the attention's output,
        # with pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, attention, next_norm: RMSNorm):
        """x: this layer's normalized input; residual: the stream, updated in place. Returns
        `next_norm` (the next layer's input norm, or the final norm) of the updated stream."""
        attn = self.self_attn(x, rope, attention)
        if not self.sandwich:
            x = self.post_attention_layernorm(attn, residual)
            return next_norm(self.mlp(x), residual)
        x = self.pre_feedforward_layernorm(self.post_attention_layernorm(attn), residual)
        return next_norm(self.post_feedforward_layernorm(self.mlp(x)), residual)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # NOTE: `_weight` skips the random init: on the meta device `normal_` would import
        # torch._dynamo (3.5 s of a cold start) to initialise values that are replaced anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Build on the `meta` device, then `load_weights` assigns the real tensors."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.sliding_rotary: RotaryEmbedding | None = None  # Gemma 3's sliding layers

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
        if self.config.sliding_rope is not None:
            self.sliding_rotary = RotaryEmbedding(self.config, max_positions, device=device,
                                                  rope=self.config.sliding_rope)

    def _layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[RopeTables | None]:
        """Each layer's cos/sin rows for these positions, looked up once per forward."""
        cfg = self.config
        tables = {id(cfg.rope): self.rotary.tables(positions, dtype)}
        if self.sliding_rotary is not None:
            tables[id(cfg.sliding_rope)] = self.sliding_rotary.tables(positions, dtype)
        ropes = [cfg.rope_of_layer(i) for i in range(cfg.num_layers)]
        return [None if rope is None else tables[id(rope)] for rope in ropes]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                stack: Callable[[torch.Tensor, RopeTables], torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden_size]. `stack`: for a step of
        decode rows only, the whole decoder stack in one compiled call (brisk/engine/decode_stack.py),
        with the same results as the layers one by one."""
        residual = self.model.embed_tokens(input_ids)  # the residual stream, added to in place
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the model's dtype, as HF does
            residual = residual * torch.tensor(self.config.embed_scale, dtype=residual.dtype)
        if stack is not None:
            return stack(residual, self.rotary.tables(positions, residual.dtype))
        ropes = self._layer_ropes(positions, residual.dtype)
        layers = self.model.layers
        x = layers[0].input_layernorm(residual)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x = layer(x, residual, ropes[i], attention, next_norm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] in float32."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits
