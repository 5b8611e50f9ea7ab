"""A decode step's decoder layers in one compiled call (`brisk/kernels/decoder.cpp`).

When every row of a step is one new token, the model's layers run as one C loop over the same
kernels the Python path calls one by one (quantized matmuls, RMSNorm, RoPE, K/V store, paged
attention, SiLU-gate), in the same order: the result is bit-identical, and a step at one row no
longer pays ~10 Python/ctypes dispatches per layer. Steps with a prompt chunk, float weights,
other devices or dtypes, or a family's extras beyond Llama's block take the Python path
(`DecoderForCausalLM.forward`);
`BRISK_DECODE_STACK=off` makes every step take it (to compare).

The per-layer table (weight and cache addresses, shapes) is built once, when the runner is made:
weights and the KV pool never move afterwards.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from brisk import kernels
from brisk.kernels import abi
from brisk.kernels.paths import compute_paths
from brisk.engine.attention import AttentionMetadata, PagedKVCache
from brisk.models.layers import RopeTables
from brisk.models.decoder import DecoderForCausalLM
from brisk.models.moe import SparseMoeBlock
from brisk.models.quant import QuantLinear, StackedQuantLinear

log = logging.getLogger("brisk.decode_stack")

def _quant_weight(linear: torch.nn.Module, bias: torch.Tensor | None = None) -> abi.QuantWeight | None:
    """The kernels' view of a quantized linear (`bias`: its own, or a slice of a stacked projection's)."""
    bias = linear.bias if bias is None else bias
    if not isinstance(linear, QuantLinear) or not all(
            t.device.type == "cpu" and t.is_contiguous()
            for t in (linear.qweight, linear.scales, linear.mins, linear.subscales) if t is not None):
        return None
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return None
    return abi.QuantWeight(linear.qweight.data_ptr(), None if linear.scales is None else linear.scales.data_ptr(),
                        None if linear.mins is None else linear.mins.data_ptr(),
                        None if linear.subscales is None else linear.subscales.data_ptr(),
                        None if bias is None else bias.data_ptr(),
                        linear.fmt.kernel_bits, linear.out_features, linear.in_features, int(linear.fmt.tiled),
                        kernels.HALF_KINDS.get(linear.fmt.half, 0))


def _qkv_weights(qkv: torch.nn.Module, gate_up_rows: int) -> tuple[abi.QuantWeight, abi.QuantWeight] | None:
    """(qkv, qkv_rest) for the layer table: one quantized weight and an empty rest, or a stacked
    projection's two parts (each with its slice of the bias; the rest is computed into the gate_up
    buffer first, so it must fit there); None where the stack cannot take it."""
    if not isinstance(qkv, StackedQuantLinear):
        return _quant_weight(qkv), abi.QuantWeight()
    if len(qkv.parts) != 2 or qkv.out_features > gate_up_rows:
        return None
    first, rest = qkv.parts
    bias = (None, None) if qkv.bias is None else (qkv.bias[:first.out_features], qkv.bias[first.out_features:])
    weights = (_quant_weight(first, bias[0]), _quant_weight(rest, bias[1]))
    return None if None in weights else weights


def _f32_vector(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


class DecodeStack:
    """Callable: (residual [rows, hidden] float32 embeddings, rope tables, step metadata) -> final
    hidden states; `residual` ends as the residual stream (as on the Python path)."""

    def __init__(self, model: DecoderForCausalLM, layers: list[abi.Layer], dims: abi.Dims):
        # the model is held so that the weights the layer table points at outlive this object. Each step calls
        # the library bound at that time (kernels.library()), never one kept here: a benchmark that swaps in
        # another build (kv_decode.py --baseline-lib) must reach the stack too
        self._model = model
        self._layers = (abi.Layer * len(layers))(*layers)
        self._dims = dims
        self._final_norm = model.model.norm.weight
        cfg = model.config
        self._widths = {"x": cfg.hidden_size, "qkv": cfg.q_size + 2 * cfg.kv_size, "q": cfg.q_size,
                        "attn": cfg.q_size, "proj": cfg.hidden_size, "gate_up": 2 * cfg.intermediate_size,
                        "act": cfg.intermediate_size}
        self._max_k = max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size)

    @classmethod
    def build(cls, model: torch.nn.Module, kv: PagedKVCache, scale: float, block_size: int) -> "DecodeStack | None":
        """The stack for this model and KV pool, or None where it does not apply (the reason is logged)."""
        lib = kernels.library()
        reason = None
        cfg = model.config
        if not compute_paths(kv.k.device).decode_stack:
            reason = "BRISK_DECODE_STACK=off, or attention off the compiled kernel"
        elif lib is None or not hasattr(lib, "brisk_decode_stack"):
            reason = "no compiled kernels"
        elif cfg.head_dim > 256 or cfg.num_heads > 128 or cfg.num_heads % cfg.num_kv_heads:
            reason = "attention shape the paged kernel does not take"
        elif not isinstance(model, DecoderForCausalLM):
            reason = f"model class {type(model).__name__}"
        elif not cfg.stack_compiles:
            reason = f"{cfg.architecture}'s block has parts the compiled stack does not run"
        elif kv.k.device.type != "cpu" or kernels.kv_code(kv.k, kv.dtype) is None:
            reason = "KV cache is not on the CPU"
        if reason is None:
            layers = []
            for i, layer in enumerate(model.model.layers):
                attn, mlp = layer.self_attn, layer.mlp
                qkv = _qkv_weights(attn.qkv_proj, 2 * cfg.intermediate_size)
                experts = mlp.compiled() if isinstance(mlp, SparseMoeBlock) else None
                dense = () if isinstance(mlp, SparseMoeBlock) else (mlp.gate_up_proj, mlp.down_proj)
                weights = [qkv and qkv[0]] + [_quant_weight(m) for m in (attn.o_proj, *dense)]
                if not dense:  # a mixture of experts: its own weights in `moe`
                    weights += [abi.QuantWeight(), abi.QuantWeight()]
                weights.append(qkv and qkv[1])
                if any(w is None for w in weights) or any(m.bias is not None for m in dense):
                    reason = f"layer {i} has float (or biased MLP) projections"
                    break
                sinks = attn.sinks
                if sinks is not None and not _f32_vector(sinks):
                    reason = f"layer {i}'s attention sinks are not float32"
                    break
                if isinstance(mlp, SparseMoeBlock) and experts is None:
                    reason = f"layer {i}'s experts are not packed in a type the compiled block takes"
                    break
                norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
                qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else ()
                if not all(_f32_vector(w) for w in (*norms, *qk_norms)):
                    reason = f"layer {i}'s norms are not float32"
                    break
                window = cfg.layer_windows[i] if cfg.layer_windows else None
                k_scale, v_scale = kv.scales(i)
                layers.append(abi.Layer(*weights, norms[0].data_ptr(), norms[1].data_ptr(), kv.k[i].data_ptr(),
                                        kv.v[i].data_ptr(), None if k_scale is None else k_scale.data_ptr(),
                                        None if v_scale is None else v_scale.data_ptr(), window or 0,
                                        {None: 0, "head": 1, "full": 2}[attn.qk_norm],
                                        *((w.data_ptr() for w in qk_norms) if qk_norms else (None, None)),
                                        experts or abi.Experts(), None if sinks is None else sinks.data_ptr()))
            if reason is None and not _f32_vector(model.model.norm.weight):
                reason = "final norm is not float32"
        if reason is not None:
            log.info("decode steps: layer by layer from Python (%s)", reason)
            return None
        dims = abi.Dims(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.rotary.rotary_dim,
                     cfg.intermediate_size, kv.dtype.code, block_size, kernels.PART_TOKENS, cfg.rms_norm_eps, scale)
        log.info("decode steps: the whole decoder stack in one compiled call")
        return cls(model, layers, dims)

    def __call__(self, residual: torch.Tensor, rope: RopeTables, meta: AttentionMetadata) -> torch.Tensor:
        rows = residual.shape[0]
        widths = self._widths
        buffers = {name: torch.empty(rows, w, dtype=torch.float32) for name, w in widths.items()}
        xq = torch.empty(rows * self._max_k, dtype=torch.int8)
        xd = torch.empty(rows * self._max_k // kernels.QK, dtype=torch.float32)
        xs = torch.empty_like(xd)
        xn = torch.empty(2 * xd.numel(), dtype=torch.int32)  # block sums, then first-half sums
        scratch = abi.Scratch(*(b.data_ptr() for b in buffers.values()), xq.data_ptr(), xd.data_ptr(), xs.data_ptr(),
                              xn.data_ptr())
        tables = meta.decode_tables.to(torch.int32).contiguous()
        lens = meta.decode_lens.to(torch.int32).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
        out = torch.empty(rows, widths["x"], dtype=torch.float32)
        code = kernels.library().brisk_decode_stack(self._layers, len(self._layers), ctypes.byref(self._dims),
                                                       self._final_norm.data_ptr(), residual.data_ptr(),
                                                       cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                                                       tables.data_ptr(), tables.shape[1], lens.data_ptr(), rows,
                                                       ctypes.byref(scratch), out.data_ptr())
        if code:  # build() checked the shapes the kernel takes; a refusal here is a bug
            raise RuntimeError(f"brisk_decode_stack refused the step (code {code})")
        return out
