"""Weight-only quantized layers: int4 and int8 in blocks of 32 input features (GGML's blocks), and
bfloat16/float16 weights kept as the checkpoint stores them (`qweight` of that dtype, no scales;
linears packed in panels of 16 rows at load, 3-D [N/16, K, 16]: brisk.kernels.pack_half).

A quantized linear `name` is stored as three tensors beside each other in the checkpoint:
`name.qweight` (uint8 [N, K/2] for int4, two values a byte in GGUF's nibble order; int8
[N, K] for int8), `name.scales` (float16 [N, K/32]) and, for formats with offsets
(GGUF Q4_1/Q4_K), `name.mins` (float16 [N, K/32]); a weight is `scale * q + min`
(int4 without offsets: `scale * (q - 8)`, GGUF Q4_0). The checkpoint describes itself: the
dtype of `qweight` gives the bit width, the presence of `mins` the offsets. int4 and int8 linears
whose rows fill tiles of 8 are stored tiled instead (3-D tensors: `qweight` [N/8, K/32, 128] for
int4, [N/8, K/32, 256] for int8, `scales` and `mins` [N/8, K/32, 8]; `brisk.kernels.tile_int4` /
`tile_int8`), the layout the kernel reads fastest at every row count; the number of dimensions
tells the layout. GGUF K-quants keep their super-block scales in tiles (`subscales`; Q4_K as int4,
Q5_K and Q6_K as int5 and int6 in tiles of 160 and 192 bytes a block, see `QuantFormat.superblocks`),
and a fused projection
whose parts come in different types (a Q4_K_M layer's Q4_K q/k and Q6_K v) is stored as its parts,
`name.parts.{i}.*` (`StackedQuantLinear`).

The matmul runs brisk's compiled kernel (`brisk.kernels`) straight from those tensors, which
on a warm start are views of the memory-mapped cache: nothing is unpacked or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from brisk import kernels
from brisk.errors import BriskError
from brisk.kernels import QK, pack_int4

QUANT_SUFFIXES = ("qweight", "scales", "mins", "subscales")
CODEBOOK = "codebook"  # iq4's table of 16 values, stored beside its blocks (it names the format; see QuantFormat.of)


HALF_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}  # 16-bit float weights kept as stored


@dataclass(frozen=True)
class QuantFormat:
    bits: int  # 4 or 8; 2/3/5/6: GGUF Q2_K/Q3_K/Q5_K/Q6_K kept as stored; 16: bfloat16/float16 weights as stored, no scales
    has_mins: bool
    # int4/int8: stored in tiles of 8 rows (brisk.kernels.tile_int4/tile_int8), the layout the kernel
    # reads fastest;
    # 16-bit: in panels of 16 rows (brisk.kernels.pack_half). Linears are stored so, embeddings
    # (looked up by row) in the row layout
    tiled: bool = False
    half: torch.dtype | None = None  # bits 16: torch.bfloat16 or torch.float16
    # K-quants kept as stored (tiled only; brisk.kernels.tile_superblocks). int4 and int5 (GGUF Q4_K,
    # Q5_K; brisk.kernels.tile_int5): `scales`/`mins` hold each row's float16 d and dmin per 256
    # weights, `subscales` each block's 6-bit sc and mn (uint8): scale = d * sc, offset = -(dmin * mn).
    # int6 and int3 (GGUF Q6_K and Q3_K, brisk.kernels.tile_int6 / tile_int3):
    # `scales` each row's float16 d per 256, `subscales` a signed sc per 16 weights (int8):
    # w = d * sc * (q - 32), int3: d * sc * (q - 4).
    # int2 (GGUF Q2_K, brisk.kernels.tile_int2): `scales`/`mins` each row's float16 d and dmin per 256,
    # `subscales` a byte per 16 weights, sc | mn << 4 (uint8): w = d * sc * q - dmin * mn
    superblocks: bool = False
    # GGUF IQ4_NL / IQ4_XS kept as stored (tiled only; brisk.kernels.IQ4): 4-bit codes (int4's tiles) into
    # kernels.IQ4_VALUES, with a float16 scale per 32 (IQ4_NL), or with `superblocks` a float16 d per 256 and
    # a signed sc per 32 (int8, IQ4_XS): w = d * sc * IQ4_VALUES[q]. The checkpoint stores the table (CODEBOOK).
    codebook: bool = False
    # MXFP4 (GGUF MXFP4, gpt-oss's experts; tiled only, with `codebook`): E2M1 codes (int4's tiles) into
    # kernels.MXFP4_VALUES with an E8M0 byte per 32 (`scales` uint8): w = 2^(e - 128) * MXFP4_VALUES[q]
    e8m0: bool = False

    @property
    def name(self) -> str:
        if self.bits == 16:
            return HALF_NAMES[self.half]
        if self.e8m0:
            return "mxfp4"
        if self.codebook:
            return "iq4" + ("/k" if self.superblocks else "")
        return f"int{self.bits}" + ("+min" if self.has_mins else "") + ("/k" if self.superblocks else "")

    @property
    def bits_per_weight(self) -> float:
        if self.bits == 16:
            return 16.0
        if self.e8m0:
            return self.bits + 8 / QK
        if self.superblocks:  # two 8-bit sub-scales per 32 weights (iq4: one), one or two float16 per 256
            return self.bits + (8 if self.codebook else 16) / QK + 16 * (2 if self.has_mins else 1) / (QK * kernels.SUPER)
        return self.bits + 16 * (2 if self.has_mins else 1) / QK

    @property
    def kernel_bits(self) -> int:
        """The kernels' `bits` for this format (brisk.kernels.quant_matmul / dequantize)."""
        if self.e8m0:
            return kernels.MXFP4
        return kernels.IQ4 if self.codebook else self.bits

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "QuantFormat | None":
        qweight = tensors.get(f"{prefix}.qweight")
        if qweight is None:
            return None
        if qweight.dtype in HALF_NAMES:  # 3-D: packed in panels of 16 rows (brisk.kernels.pack_half)
            return cls(16, False, qweight.dim() == 3, qweight.dtype)
        if qweight.dtype == torch.int8:
            bits = 8
        else:  # uint8: int4, or tiled int2/int3/int5/int6 (told by their tiles' bytes a block)
            bits = {kernels.TILE_BYTES[b]: b for b in (2, 3, 5, 6)}.get(qweight.shape[-1], 4) if qweight.dim() == 3 else 4
        codebook = tensors.get(f"{prefix}.{CODEBOOK}")
        table = None if codebook is None else tuple(codebook.tolist())
        if table is not None and table not in (kernels.IQ4_VALUES, kernels.MXFP4_VALUES):
            raise BriskError(f"checkpoint tensor {prefix}.{CODEBOOK} holds {list(table)}, not the IQ4 or MXFP4 table "
                             "the kernels know; convert the model again")
        return cls(bits, f"{prefix}.mins" in tensors, qweight.dim() == 3, superblocks=f"{prefix}.subscales" in tensors,
                   codebook=codebook is not None, e8m0=table == kernels.MXFP4_VALUES)


class _Blocks(nn.Module):
    """The quantized tensors of one [N, K] weight, as buffers (loaded with `assign=True`)."""

    def __init__(self, rows: int, cols: int, fmt: QuantFormat):
        super().__init__()
        self.fmt = fmt
        if fmt.bits == 16:  # 16-bit floats: rows as stored, or in panels of 16 rows; no scales
            shape = (rows // kernels.HALF_PANEL, cols, kernels.HALF_PANEL) if fmt.tiled else (rows, cols)
            self.register_buffer("qweight", torch.empty(shape, dtype=fmt.half))
            self.scales = self.mins = self.subscales = None
            return
        if cols % QK:
            raise BriskError(f"a {rows}x{cols} weight cannot be quantized in blocks of {QK}: "
                             f"its {cols} input features are not a multiple of {QK}; use --quantization none")
        tiles, nb = rows // kernels.TILE_ROWS, cols // QK
        if fmt.superblocks:
            if not fmt.tiled or cols % (QK * kernels.SUPER):
                raise BriskError(f"a {rows}x{cols} weight cannot take super-block scales; convert the model again")
            qshape, sshape = (tiles, nb, kernels.TILE_BYTES[fmt.bits]), (tiles, nb // kernels.SUPER, kernels.TILE_ROWS)
            signed = fmt.bits in kernels.SIGNED_OFFSETS or fmt.codebook
            self.register_buffer("subscales", torch.empty((tiles, nb, (1 if fmt.codebook else 2) * kernels.TILE_ROWS),
                                                          dtype=torch.int8 if signed else torch.uint8))
        elif fmt.tiled:
            qshape, sshape = (tiles, nb, kernels.TILE_BYTES[fmt.bits]), (tiles, nb, kernels.TILE_ROWS)
        else:
            qshape, sshape = ((rows, cols // 2) if fmt.bits == 4 else (rows, cols)), (rows, cols // QK)
        self.register_buffer("qweight", torch.empty(qshape, dtype=torch.int8 if fmt.bits == 8 else torch.uint8))
        self.register_buffer("scales", torch.empty(sshape, dtype=torch.uint8 if fmt.e8m0 else torch.float16))
        if not fmt.superblocks:
            self.subscales = None
        if fmt.has_mins:
            self.register_buffer("mins", torch.empty(sshape, dtype=torch.float16))
        else:
            self.mins = None
        if fmt.codebook:
            self.register_buffer(CODEBOOK, torch.empty(16, dtype=torch.int8))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return kernels.dequantize(self.qweight, self.scales, self.mins, self.fmt.kernel_bits, dtype, self.subscales)


class QuantLinear(_Blocks):
    """y = x W^T (+ b), W quantized; same call interface as `brisk.models.linear.Linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: QuantFormat):
        super().__init__(out_features, in_features, fmt)
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        if self.fmt.bits == 16:
            out = kernels.half_matmul(flat, self.qweight, self.out_features)
        else:
            out = kernels.quant_matmul(flat, self.qweight, self.scales, self.mins, self.fmt.kernel_bits, self.subscales)
        if self.bias is not None:
            out += self.bias
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class StackedQuantLinear(nn.Module):
    """A fused projection whose parts keep different quantized formats (a GGUF Q4_K_M layer's Q4_K
    attn_q/attn_k with its Q6_K attn_v): `parts` (QuantLinear each, their output rows stacked in
    order), one bias over all of them. The checkpoint stores `name.parts.{i}.*` for each part."""

    def __init__(self, in_features: int, parts: list[tuple[int, QuantFormat]], bias: bool):
        super().__init__()
        self.parts = nn.ModuleList(QuantLinear(in_features, rows, False, fmt) for rows, fmt in parts)
        self.in_features, self.out_features = in_features, sum(rows for rows, _ in parts)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    @property
    def format_name(self) -> str:
        return " & ".join(p.fmt.name for p in self.parts)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantized(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias.to(out.dtype)


PARTS = ".parts."  # a stacked projection's parts in the checkpoint: `name.parts.{i}.qweight`


def part_rows(tensors: dict[str, torch.Tensor], prefix: str, fmt: QuantFormat) -> int:
    """The output rows of the quantized weight stored at `prefix` (tiled, or the row layout)."""
    qweight = tensors[f"{prefix}.qweight"]
    return qweight.shape[0] * (kernels.TILE_ROWS if fmt.tiled else 1)


class QuantEmbedding(_Blocks):
    """Token embeddings stored quantized; looked-up rows are dequantized (T rows per step). Stored in
    tiles like a linear's (so that a tied LM head reads them with the tiled kernel), a lookup takes
    each id's tile and picks its row out of it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: QuantFormat, dtype: torch.dtype):
        super().__init__(num_embeddings, embedding_dim, fmt)
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.fmt.tiled:
            scales = None if self.scales is None else self.scales[ids]
            mins = None if self.mins is None else self.mins[ids]
            return kernels.dequantize(self.qweight[ids], scales, mins, self.fmt.bits, self.dtype)
        flat = ids.reshape(-1)
        tiles = flat // kernels.TILE_ROWS
        picked = torch.arange(flat.numel(), device=flat.device) * kernels.TILE_ROWS + flat % kernels.TILE_ROWS
        if self.fmt.bits in kernels.SIGNED_OFFSETS:
            rows = kernels.signed_rows(self.qweight[tiles], self.scales[tiles], self.subscales[tiles], self.fmt.bits)
            values = kernels.dequantize_signed(*(t[picked] for t in rows), self.fmt.bits, self.dtype)
            return values.view(*ids.shape, self.embedding_dim)
        if self.fmt.e8m0:
            values = kernels.dequantize_mxfp4(self.qweight[tiles], self.scales[tiles], self.dtype)[picked]
            return values.view(*ids.shape, self.embedding_dim)
        if self.fmt.codebook:
            sub = None if self.subscales is None else self.subscales[tiles]
            values = kernels.dequantize_iq4(self.qweight[tiles], self.scales[tiles], sub, self.dtype)[picked]
            return values.view(*ids.shape, self.embedding_dim)
        if self.fmt.bits == 2:
            rows = kernels.int2_rows(self.qweight[tiles], self.scales[tiles], self.mins[tiles], self.subscales[tiles])
            values = kernels.dequantize_int2(*(t[picked] for t in rows), self.dtype)
            return values.view(*ids.shape, self.embedding_dim)
        scales, mins = self.scales[tiles], None if self.mins is None else self.mins[tiles]
        if self.subscales is not None:
            scales, mins = kernels.superblock_scales(scales, mins, self.subscales[tiles])
        n, nb = flat.numel() * kernels.TILE_ROWS, self.embedding_dim // QK
        rows = (kernels.untile_values(self.qweight[tiles], self.fmt.bits), kernels.untile_side(scales, n, nb),
                kernels.untile_side(mins, n, nb))
        q, scales, mins = (None if t is None else t[picked] for t in rows)
        values = kernels.dequantize_values(q, scales, mins, self.fmt.bits, self.dtype)
        return values.view(*ids.shape, self.embedding_dim)


# ------------------------------------------------------------------ quantizing float weights

def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16)


def quantize_int4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float [N, K] -> int4 with a scale and an offset per block (GGUF Q4_1's scheme)."""
    n, k = w.shape
    blocks = w.float().view(n, k // QK, QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scales, mins = _fp16((hi - lo) / 15), _fp16(lo)
    d, m = scales.float(), mins.float()
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((blocks - m[..., None]) * inv[..., None]).clamp_(0, 15)
    return {"qweight": pack_int4(q.view(n, k)), "scales": scales, "mins": mins}


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float [N, K] -> int8 with one scale per block (GGUF Q8_0's scheme)."""
    n, k = w.shape
    blocks = w.float().view(n, k // QK, QK)
    scales = _fp16(blocks.abs().amax(-1) / 127)
    d = scales.float()
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return {"qweight": q.view(n, k), "scales": scales}


def keep_bf16(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float [N, K] -> bfloat16 as is (a bfloat16 checkpoint's tensor is used in place, a view of the
    memory-mapped file); multiplied with float32 activations by half_matmul.cpp."""
    return {"qweight": w.to(torch.bfloat16).contiguous()}


def keep_f16(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float [N, K] -> float16 as is (see keep_bf16)."""
    return {"qweight": w.to(torch.float16).contiguous()}


QUANTIZERS = {"int4": quantize_int4, "int8": quantize_int8, "bf16": keep_bf16, "f16": keep_f16}
HALF_METHODS = {"bf16": torch.bfloat16, "f16": torch.float16}  # the QUANTIZERS that keep 16-bit floats


def tileable(name: str, fmt: QuantFormat | None, rows: int) -> bool:
    """Whether a weight is stored tiled: int4/int8 linears and token embeddings (a tied LM head
    multiplies by them) whose rows fill whole tiles of 8, and 16-bit linears whose rows fill whole
    panels of 16 (brisk.kernels.pack_half)."""
    if fmt is None:
        return False
    if fmt.bits == 16:
        return is_quantizable_weight(name) and rows % kernels.HALF_PANEL == 0
    return ((is_quantizable_weight(name) or name == "model.embed_tokens.weight") and fmt.bits in kernels.TILE_BYTES
            and rows % kernels.TILE_ROWS == 0)


def tile(blocks: dict[str, torch.Tensor], bits: int | None = None) -> dict[str, torch.Tensor]:
    """A weight's int4/int8 blocks (qweight/scales/mins) in the row layout -> the tiled layout; 16-bit
    weights -> panels. `bits` tells Q3_K's values (3) from Q6_K's (else 6), which share signed sub-scales, and
    Q2_K's (2) from Q5_K's, both one value a byte with uint8 sub-scales."""
    if blocks["qweight"].dtype in HALF_NAMES:
        return {"qweight": kernels.pack_half(blocks["qweight"])}
    if CODEBOOK in blocks:  # iq4: int4's tiles of the codes; IQ4_NL's scales as int4's, IQ4_XS's as K-quants'
        if "subscales" not in blocks:
            qweight, scales, _ = kernels.tile_int4(blocks["qweight"], blocks["scales"], None)
            return {"qweight": qweight, "scales": scales, CODEBOOK: blocks[CODEBOOK]}
        scales, _, sub = kernels.tile_superblocks(blocks["scales"], None, blocks["subscales"])
        return {"qweight": kernels.tile_int4(blocks["qweight"], None, None)[0], "scales": scales, "subscales": sub,
                CODEBOOK: blocks[CODEBOOK]}
    if "subscales" in blocks:  # K-quants kept as stored: Q6_K's/Q3_K's signed sub-scales; Q5_K's values one a byte; Q4_K
        q, sub = blocks["qweight"], blocks["subscales"]
        if sub.dtype == torch.int8:
            qweight = kernels.tile_values(q, 3 if bits == 3 else 6)
        else:
            values = bits == 2 or q.shape[1] == sub.shape[1] * QK  # one a byte (int2, int5), else int4's nibbles
            qweight = kernels.tile_values(q, 2 if bits == 2 else 5) if values else kernels.tile_int4(q, None, None)[0]
        scales, mins, sub = kernels.tile_superblocks(blocks["scales"], blocks.get("mins"), blocks["subscales"])
        return {"qweight": qweight, "scales": scales, "subscales": sub, **({"mins": mins} if mins is not None else {})}
    tile_blocks = kernels.tile_int4 if blocks["qweight"].dtype == torch.uint8 else kernels.tile_int8
    qweight, scales, mins = tile_blocks(blocks["qweight"], blocks["scales"], blocks.get("mins"))
    return {"qweight": qweight, "scales": scales, **({"mins": mins} if mins is not None else {})}


def check_quantizable(name: str, shape: tuple[int, ...], method: str) -> None:
    if len(shape) == 2 and method in HALF_METHODS:  # 16-bit floats take any matrix
        return
    if len(shape) != 2 or shape[1] % QK:
        raise BriskError(f"--quantization {method}: tensor {name} has shape {list(shape)}; its input dimension "
                         f"must be a multiple of the group size {QK}; use --quantization none for this model")


def is_quantizable_weight(name: str) -> bool:
    """Linear weights (and the LM head) are quantized at load; norms, biases and embeddings are not."""
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def converts(name: str, method: str) -> bool:
    """Whether `--quantization method` stores checkpoint tensor `name` in its format at load: the
    linears for every method, and the token embeddings too when the method keeps 16-bit floats (rows
    widened as they are looked up; a tied LM head reads the same 16-bit table)."""
    return is_quantizable_weight(name) or (method in HALF_METHODS and name == "model.embed_tokens.weight")


def method_format(method: str) -> QuantFormat:
    """The format a `--quantization` method gives a float weight."""
    if method in HALF_METHODS:
        return QuantFormat(16, False, False, HALF_METHODS[method])
    return QuantFormat(4, True) if method == "int4" else QuantFormat(8, False)


# ------------------------------------------------------------------ installing into a model

def install(model: nn.Module, tensors: dict[str, torch.Tensor], tie_word_embeddings: bool,
            dtype: torch.dtype) -> dict[str, str]:
    """Swap every linear/embedding whose checkpoint tensors are quantized for its quantized
    class (the model is still on the `meta` device). Returns {module name: format name}."""
    formats: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if getattr(module, "stacks_experts", False):  # brisk.models.moe.install_experts gives these theirs
            continue
        fmt = QuantFormat.of(tensors, name)
        if fmt is None and f"{name}{PARTS}0.qweight" in tensors and isinstance(module, nn.Linear):
            prefixes = []
            while f"{name}{PARTS}{len(prefixes)}.qweight" in tensors:
                prefixes.append(f"{name}{PARTS}{len(prefixes)}")
            parts = [(part_rows(tensors, p, f), f) for p, f in ((p, QuantFormat.of(tensors, p)) for p in prefixes)]
            if sum(rows for rows, _ in parts) != module.out_features or any(f.bits == 16 for _, f in parts):
                raise BriskError(f"checkpoint tensors {name}{PARTS}* do not make up {name} "
                                 f"({module.out_features} rows); convert the model again")
            replacement = StackedQuantLinear(module.in_features, parts, module.bias is not None)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
            formats[name] = replacement.format_name
            continue
        if fmt is None:
            continue
        if isinstance(module, nn.Embedding):
            replacement = QuantEmbedding(module.num_embeddings, module.embedding_dim, fmt, dtype)
        elif isinstance(module, nn.Linear):
            replacement = QuantLinear(module.in_features, module.out_features, module.bias is not None, fmt)
        else:
            raise BriskError(f"checkpoint tensor {name}.qweight belongs to a {type(module).__name__}, "
                             "which brisk cannot run quantized")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        formats[name] = fmt.name
    if tie_word_embeddings and "model.embed_tokens" in formats:
        embed = model.get_submodule("model.embed_tokens")
        model.lm_head = QuantLinear(embed.embedding_dim, embed.num_embeddings, False, embed.fmt)
        formats["lm_head"] = formats["model.embed_tokens"]
    return formats

