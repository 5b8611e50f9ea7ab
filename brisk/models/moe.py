"""The mixture-of-experts layer: a router picks each token's k experts, and the step's rows are grouped by
expert so that each chosen expert's weights are read once per step however many rows chose it (what
llama.cpp's `ggml_mul_mat_id` and vLLM's CPU fused MoE do).

Experts are stored stacked, as GGUF stores them (`ffn_{gate,up,down}_exps`: experts x out x in) and
transformers 5 holds them: `experts.gate_up_proj` [E, 2 * I, H] (each expert's gate rows, then its up rows)
and `experts.down_proj` [E, H, I], in float, or in any format brisk packs a linear in (the GGUF's own
quantized blocks, kept packed; bfloat16/float16 as stored) with a leading expert dimension on every tensor.
Where an expert's gate and up come in different quantized types, they are stored as two parts
(`gate_up_proj.parts.{0,1}.*`).

Routing follows transformers' SparseMoeBlock of each family (the reference): softmax over the router's
logits in float32, the top k, renormalised to sum 1 where `norm_topk_prob`; Qwen2-MoE adds a shared
expert every token takes, times the sigmoid of its own one-output gate.

A row's output does not depend on its batch: the grouped matmuls are row-invariant (brisk's kernels), and
each row sums its experts' contributions in the same order (by expert id) whether it is alone or among
others, so a request's greedy tokens do not depend on what it is batched with.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from brisk import kernels
from brisk.kernels import abi
from brisk.config import ModelConfig
from brisk.errors import BriskError
from brisk.kernels import fused
from brisk.models.linear import Linear
from brisk.models.quant import CODEBOOK, PARTS, QuantFormat, _Blocks

_SUFFIXES = ("qweight", "scales", "mins", "subscales")


class ExpertLinear(nn.Module):
    """E linears [N, K] stacked: a float `weight` [E, N, K], or quantized blocks (or 16-bit weights) with a
    leading expert dimension, laid out per expert exactly as a QuantLinear's."""

    stacks_experts = True  # brisk.models.quant.install leaves it to install_experts

    def __init__(self, num_experts: int, in_features: int, out_features: int, fmt: QuantFormat | None = None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features, self.fmt = num_experts, in_features, out_features, fmt
        self._linears: list[Linear] | None = None  # float experts: each as a Linear (oneDNN packed on first use)
        if fmt is None:
            self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
            return
        one = _Blocks(out_features, in_features, fmt)  # the buffers of one expert, on the device it is built on
        for suffix in _SUFFIXES:
            t = getattr(one, suffix, None)
            if t is None:
                setattr(self, suffix, None)
            else:
                self.register_buffer(suffix, torch.empty((num_experts, *t.shape), dtype=t.dtype))
        if fmt.codebook:
            self.register_buffer(CODEBOOK, torch.empty(16, dtype=torch.int8))

    @property
    def format_name(self) -> str:
        return "float" if self.fmt is None else self.fmt.name

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [rows, K] -> [rows, N] through expert `expert`."""
        if self.fmt is None:
            return self._expert_linear(expert)(x)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        if self.fmt.bits == 16:
            return kernels.half_matmul(x, self.qweight[expert], self.out_features)
        return kernels.quant_matmul(x, self.qweight[expert], self.scales[expert],
                                    None if self.mins is None else self.mins[expert], self.fmt.kernel_bits,
                                    None if self.subscales is None else self.subscales[expert])

    def grouped(self, x: torch.Tensor, experts: list[int], offsets: list[int]) -> torch.Tensor:
        """x [A, K], its rows grouped by expert (rows offsets[i] .. offsets[i + 1] - 1 through experts[i]) -> [A, N].
        Tiled quantized experts in one compiled call (kernels.quant_matmul_experts), the others expert by expert."""
        fmt = self.fmt
        if fmt is not None and fmt.tiled and fmt.bits != 16 and x.device.type == "cpu":
            x = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
            return kernels.quant_matmul_experts(x, self.qweight, self.scales, self.mins, fmt.kernel_bits, self.subscales,
                                                experts, offsets)
        return torch.cat([self(x[offsets[i]:offsets[i + 1]], e) for i, e in enumerate(experts)])

    def _expert_linear(self, expert: int) -> Linear:
        """A float expert as the dense layers' Linear (a view of its weight, packed for oneDNN on first use): the
        same row-invariant matmul, so a row's output does not depend on how many rows chose the expert (torch's
        F.linear changes a row's last bits with the row count). The packed copies sit beside the float weights;
        a float mixture of experts is a test-sized one (served checkpoints are quantized or 16-bit)."""
        if self._linears is None:
            self._linears = []
            for e in range(self.num_experts):
                linear = Linear(self.in_features, self.out_features, bias=False, device="meta")
                linear.weight = nn.Parameter(self.weight[e], requires_grad=False)
                self._linears.append(linear)
        return self._linears[expert]

    def dequantized(self, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fmt is None:
            return self.weight[expert].to(dtype)
        return kernels.dequantize(self.qweight[expert], self.scales[expert] if self.scales is not None else None,
                                  None if self.mins is None else self.mins[expert], self.fmt.kernel_bits, dtype,
                                  None if self.subscales is None else self.subscales[expert])


class StackedExpertLinear(nn.Module):
    """Expert projections whose parts keep different formats (gate in one quantized type, up in another):
    the parts' output rows in order, as StackedQuantLinear stacks a dense projection's."""

    stacks_experts = True

    def __init__(self, num_experts: int, in_features: int, parts: list[tuple[int, QuantFormat]]):
        super().__init__()
        self.parts = nn.ModuleList(ExpertLinear(num_experts, in_features, rows, fmt) for rows, fmt in parts)
        self.num_experts, self.in_features = num_experts, in_features
        self.out_features = sum(rows for rows, _ in parts)

    @property
    def format_name(self) -> str:
        return " & ".join(p.format_name for p in self.parts)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return torch.cat([p(x, expert) for p in self.parts], dim=-1)

    def grouped(self, x: torch.Tensor, experts: list[int], offsets: list[int]) -> torch.Tensor:
        return torch.cat([p.grouped(x, experts, offsets) for p in self.parts], dim=-1)

    def dequantized(self, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantized(expert, dtype) for p in self.parts])


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's gate over [.., 2 * I] (gate columns, then up): the gate clamped above at `limit`, the up to
    +-`limit`, then (up + 1) * gate * sigmoid(alpha * gate), as transformers' GptOssExperts computes it."""
    def gate(gate_up: torch.Tensor) -> torch.Tensor:
        g, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        g = g.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))
    return gate


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, biases: bool = False, gate=None):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = ExpertLinear(num_experts, hidden, 2 * intermediate)
        self.down_proj = ExpertLinear(num_experts, intermediate, hidden)
        self.gate = gate or fused.silu_mul
        # gpt-oss: a bias per expert on each projection ([E, 2 * I]: gate's, then up's; [E, H])
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if biases else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if biases else None

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; top_ids, top_weights [T, k] -> [T, H]: each row's weighted sum of its experts' SwiGLU. The
        (row, choice) pairs are grouped by expert, so each chosen expert's weights are read once for all the rows
        that chose it; each row then sums its k outputs in its own choice order, the same alone or in a batch."""
        rows, k = top_ids.shape
        flat = top_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, rows ascending within one
        counts = torch.bincount(flat, minlength=self.num_experts)
        experts = torch.nonzero(counts).flatten()
        offsets = [0] + torch.cumsum(counts[experts], 0).tolist()
        experts = experts.tolist()
        grouped = x[order // k]  # [rows * k, H]
        gate_up = self.gate_up_proj.grouped(grouped, experts, offsets)
        by_expert = flat[order] if self.gate_up_proj_bias is not None else None  # each grouped row's expert
        if by_expert is not None:
            gate_up = gate_up + self.gate_up_proj_bias[by_expert].to(gate_up.dtype)
        h = self.gate(gate_up)
        y = self.down_proj.grouped(h, experts, offsets)  # [rows * k, H], grouped by expert
        if by_expert is not None:
            y = y + self.down_proj_bias[by_expert].to(y.dtype)
        by_choice = torch.empty_like(y)
        by_choice[order] = y
        by_choice = by_choice.view(rows, k, -1) * top_weights.to(y.dtype)[:, :, None]
        out = by_choice[:, 0].clone()
        for j in range(1, k):  # one addition at a time: a row's sum has the same order in any batch
            out += by_choice[:, j]
        return out


def route(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (top ids [T, k], their weights [T, k] float32): softmax, top k, and
    renormalised to sum 1 where asked (transformers' TopKRouter)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def route_top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router: the top k logits, softmaxed among themselves (transformers' GptOssTopKRouter)."""
    values, ids = torch.topk(logits.float(), k, dim=-1)
    return ids, torch.softmax(values, dim=-1)


class SharedExpertMLP(nn.Module):
    """Qwen2-MoE's shared expert: a dense SwiGLU MLP every token takes."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as a mixture of experts (in place of DecoderMLP)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        if cfg.hidden_act != "silu":
            raise BriskError(f"{cfg.architecture}: experts with activation {cfg.hidden_act!r} are not implemented "
                             "(brisk's experts are SwiGLU)")
        self.top_k, self.renormalise, self.oai = moe.experts_per_token, moe.norm_topk_prob, moe.oai
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=moe.oai)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size, biases=moe.oai,
                               gate=clamped_swiglu(moe.swiglu_alpha, moe.swiglu_limit) if moe.oai else None)
        self.swiglu = (moe.swiglu_alpha, moe.swiglu_limit)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(cfg.hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def compiled(self) -> abi.Experts | None:
        """The routed part of this block as the compiled kernels take it (moe.cpp: router, top k, grouped experts
        and their weighted sum in one call, which the compiled decode step calls too), built on first use; None
        where the torch path runs: no library, a router that is not float32 on the CPU, experts that are float
        or 16-bit or whose gate and up come in two formats."""
        if not hasattr(self, "_compiled"):
            self._compiled = self._compiled_block()
        return self._compiled

    def _compiled_block(self) -> abi.Experts | None:
        router = getattr(self.gate, "weight", None)
        if (kernels.library() is None or type(self.gate) is not Linear or router is None
                or (self.gate.bias is not None) != self.oai or not _cpu_f32(router)):
            return None
        gate_up, down = expert_weight(self.experts.gate_up_proj), expert_weight(self.experts.down_proj)
        if gate_up is None or down is None:
            return None
        block = abi.Experts(router.data_ptr(), gate_up, down, self.experts.num_experts, self.top_k, int(self.renormalise))
        if self.oai:  # gpt-oss: the router's and the experts' biases, the clamped SwiGLU
            biases = (self.gate.bias, self.experts.gate_up_proj_bias, self.experts.down_proj_bias)
            if not all(_cpu_f32(b) for b in biases):
                return None
            block.router_bias, block.gate_up_bias, block.down_bias = (b.data_ptr() for b in biases)
            block.oai, block.swiglu_alpha, block.swiglu_limit = 1, self.swiglu[0], self.swiglu[1]
        return block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (the post-attention norm's output) -> [T, H]."""
        block = self.compiled() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        if block is not None:
            x = x.contiguous()
            out = torch.empty_like(x)
            if kernels.library().brisk_moe_block(ctypes.byref(block), x.data_ptr(), x.shape[0], out.data_ptr()):
                raise RuntimeError("brisk_moe_block refused weights _compiled_block accepted")  # a bug, not input
        else:
            logits = self.gate(x)
            if self.oai:
                ids, weights = route_top_logits(logits, self.top_k)
            else:
                ids, weights = route(logits, self.top_k, self.renormalise)
            out = self.experts(x, ids, weights)
        if hasattr(self, "shared_expert"):
            out += torch.sigmoid(self.shared_expert_gate(x).float()) * self.shared_expert(x).float()
        return out.to(x.dtype)


def _cpu_f32(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def expert_weight(linear: nn.Module) -> abi.ExpertWeight | None:
    """A stacked expert projection as the compiled kernels take it (tiled quantized, one format, contiguous on the
    CPU; expert e's arrays at the first expert's plus e strides), or None."""
    fmt = getattr(linear, "fmt", None)
    if not isinstance(linear, ExpertLinear) or fmt is None or not fmt.tiled or fmt.bits == 16:
        return None
    arrays = (linear.qweight, linear.scales, linear.mins, linear.subscales)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in arrays if t is not None):
        return None

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    def stride(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.stride(0) * t.element_size()

    weight = abi.QuantWeight(ptr(linear.qweight), ptr(linear.scales), ptr(linear.mins), ptr(linear.subscales), None,
                             fmt.kernel_bits, linear.out_features, linear.in_features, 1, 0)
    return abi.ExpertWeight(weight, *(stride(t) for t in arrays))


def expert_parts(tensors: dict[str, torch.Tensor], prefix: str) -> list[str]:
    """The stored parts of a stacked expert projection (`prefix.parts.{i}`), or [] when it is stored whole."""
    parts = []
    while f"{prefix}{PARTS}{len(parts)}.qweight" in tensors:
        parts.append(f"{prefix}{PARTS}{len(parts)}")
    return parts


def expert_format(tensors: dict[str, torch.Tensor], prefix: str) -> QuantFormat | None:
    """The format of a stacked expert weight stored at `prefix`, read from its first expert's tensors."""
    first = {f"{prefix}.{s}": tensors[f"{prefix}.{s}"][0] for s in _SUFFIXES if f"{prefix}.{s}" in tensors}
    if f"{prefix}.{CODEBOOK}" in tensors:
        first[f"{prefix}.{CODEBOOK}"] = tensors[f"{prefix}.{CODEBOOK}"]
    return QuantFormat.of(first, prefix)


def _part_rows(tensors: dict[str, torch.Tensor], prefix: str) -> int:
    """Output rows of the stacked expert weight at `prefix` ([E, N/8, ...] tiled, [E, N, ...] by rows)."""
    tiled = tensors[f"{prefix}.qweight"].dim() == 4
    return tensors[f"{prefix}.scales"].shape[1] * (kernels.TILE_ROWS if tiled else 1)


def install_experts(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Give every stacked expert projection the format its checkpoint tensors are stored in (the model is
    still on the `meta` device). Returns {module name: format name}."""
    formats: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, ExpertLinear):
            continue
        parts = expert_parts(tensors, name)
        with torch.device("meta"):
            if parts:
                stacked = [(_part_rows(tensors, p), expert_format(tensors, p)) for p in parts]
                if sum(rows for rows, _ in stacked) != module.out_features:
                    raise BriskError(f"checkpoint tensors {name}{PARTS}* do not make up {name} "
                                     f"({module.out_features} rows); convert the model again")
                replacement = StackedExpertLinear(module.num_experts, module.in_features, stacked)
            elif f"{name}.qweight" in tensors:
                replacement = ExpertLinear(module.num_experts, module.in_features, module.out_features,
                                           expert_format(tensors, name))
            else:
                continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, replacement)
        formats[name] = replacement.format_name
    return formats
