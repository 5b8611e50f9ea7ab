"""GGUF -> brisk's converted cache (safetensors + config.json + tokenizer files).

The first start with a GGUF file writes a converted copy into the cache directory, keyed by
the file's size, mtime, a hash of its first MiB and the `--quantization` mode; every later
start memory-maps that copy (zero-copy) instead. Tensors are written one at a time by a
streaming safetensors writer, so memory stays bounded by the two largest (fused) tensors, and the
result appears atomically (temp dir, rename).

Quantized weights stay quantized (`brisk.models.quant`'s int4/int8 blocks of 32): with the
default `auto` mode Q4_0, Q4_1 and Q8_0 are repacked by slicing their bytes (exact), Q4_K
keeps its super-block scales (each row's float16 d/dmin per 256 and 6-bit sc/mn per 32; exact,
4.625 bits a weight) in tiles (a weight whose rows do not fill tiles of 8 maps onto int4 with a
float16 scale and offset per 32, exact up to rounding each block's `d * sc` to float16), Q6_K
likewise keeps its 6-bit values and scales (each row's float16 d per 256, a signed 8-bit sc per 16;
exact, 6.5625 bits a weight), Q3_K its 3-bit values with Q6_K's kind of scales (its 6-bit sc held
in a byte: 3.5625 bits a weight against the file's 3.4375), Q2_K its 2-bit values, float16 d/dmin
per 256 and 4-bit sc/mn per 16 as stored (2.625 bits, the file's), IQ4_NL and IQ4_XS their 4-bit
codes into the IQ4 table with their scales (4.5 bits, the file's; IQ4_XS 4.3125 against 4.25) and
Q5_K its 5-bit values with Q4_K's scales (5.625 bits), each in tiles of its own (rows that do not
fill tiles: int8); Q5_0/Q5_1, whose 5-bit values have no kernel, are requantized to int8 blocks
from their dequantized values (a half int8 step of extra error).
`none` dequantizes everything to float32; `int8`/`int4` requantize every weight matrix.
Float matrices stored as F16 or BF16 (llama.cpp's `--outtype f16|bf16`) stay 16-bit in `auto`,
bit for bit; the loader then keeps them so on CPU (`_auto_weights`), as for a bf16 safetensors
checkpoint.

The byte moves over every weight (K-quant values and nibbles, their scales, the tiles) run compiled
(`brisk.loading.repack`, `brisk/kernels/repack.cpp`; numpy/torch without the kernels, the same bytes), and
one thread writes a tensor while the next is produced: a Mistral-7B-shaped Q4_K_M converts in ~9-13 s
where it took ~40 s (benchmarks/RESULTS.md).

The converted safetensors use brisk's layout: q/k/v and gate/up already fused
(`qkv_proj`, `gate_up_proj`), so a warm start does no copy at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from brisk.errors import ModelLoadError
from brisk.families import FAMILIES, Family
from brisk.kernels import IQ4_VALUES, MXFP4_VALUES, QK, SIGNED_OFFSETS, TILE_BYTES, TILE_ROWS
from brisk.loading import repack
from brisk.loading.dequant import (DEQUANTIZERS, IQ4_XS_BYTES, Q2_K_BYTES, Q3_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K,
                                   _k_scales_mins, check_type, q2_k_scales, q3_k_scales, q6_k_scales)
from brisk.loading.gguf_header import BRISK_LAYOUT, GGUFFile, TensorInfo, hf_config, read_gguf_header  # noqa: F401 (callers import hf_config here)
from brisk.loading.gguf_tokenizer import build_tokenizer
from brisk.models.quant import CODEBOOK, PARTS, QUANTIZERS, QuantFormat, check_quantizable, tile, tileable

log = logging.getLogger("brisk.loading")

CONVERT_VERSION = 10  # 4: rope_freqs.weight read (Llama 3.1+ ran with plain RoPE before); 5: new families;
# 6: F16/BF16 matrices kept 16-bit in auto; 7: int8 linears tiled; 8: Q4_K kept with its super-block scales;
# 9: Q6_K kept as stored; 10: Q5_K too, and fused parts of different types stored apart (Q3_K, Q2_K and
# IQ4_NL/IQ4_XS, refused before, needed no new version: no cache of them existed)
_HASHED_PREFIX_BYTES = 1 << 20

_PLAIN_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# a layer's GGUF tensor -> its name in brisk's model, where present (q/k norms: Qwen3, Gemma 3)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 2/3 norm the attention's output and the MLP's input and output: llama.cpp's ffn_norm is
# then the norm before the MLP, and post_attention_norm the one of the attention's output
_SANDWICH_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# fused output name -> GGUF parts in order; Phi-3's GGUFs store them fused already (attn_qkv, and
# ffn_up holding gate and up)
_FUSED = {
    "self_attn.qkv_proj.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "self_attn.qkv_proj.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "mlp.gate_up_proj.weight": ("ffn_gate.weight", "ffn_up.weight"),
}
_STORED_FUSED = {"self_attn.qkv_proj.weight": ("attn_qkv.weight",), "self_attn.qkv_proj.bias": ("attn_qkv.bias",),
                 "mlp.gate_up_proj.weight": ("ffn_up.weight",)}
# an MoE layer's GGUF tensors: the router, the experts (3-D: experts x out x in), Qwen2-MoE's shared expert
_ROUTER = {"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
           "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
_SHARED_FUSED = {"mlp.shared_expert.gate_up_proj.weight": ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")}
EXPERT_TENSORS = {"mlp.experts.gate_up_proj.weight": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                  "mlp.experts.down_proj.weight": ("ffn_down_exps.weight",)}
EXPERT_MARK = "#"  # `blk.0.ffn_up_exps.weight#5`: expert 5's [out, in] slice of the stacked tensor


def shared_codebooks(infos: list[TensorInfo]) -> set[str]:
    """GGUF tensors fused after a first part of the same type (attn_k/attn_v after attn_q, ffn_up after ffn_gate,
    and their experts'): the fused weight stores one IQ4 table, the first part's (the memory plan's count)."""
    types = {t.name: t.type_name for t in infos}
    later = {}
    for parts in (*_FUSED.values(), *_SHARED_FUSED.values(), *EXPERT_TENSORS.values()):
        for part in parts[1:]:
            later[part] = parts[0]
    shared = set()
    for name, kind in types.items():
        layer, _, part = name.partition(".")[2].partition(".")
        first = later.get(part)
        if name.startswith("blk.") and first is not None and types.get(f"blk.{layer}.{first}") == kind:
            shared.add(name)
    return shared


# gpt-oss: the norm before the MLP is post_attention_norm; biases on the attention's output, the router and the
# experts (gate's and up's bias [E, I] each, joined along I at load: brisk.loading.loader._oai_experts); the sinks
_OAI_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight", "attn_output.bias": "self_attn.o_proj.bias",
              "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.bias": "mlp.gate.bias",
              "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias", "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
              "ffn_down_exps.bias": "mlp.experts.down_proj_bias"}


def _names_of(family: Family) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """A family's layer tensor names: (GGUF -> brisk, fused brisk name -> GGUF parts)."""
    layer_names = _SANDWICH_NAMES if family.gguf_tensors == "sandwich" else _LAYER_NAMES
    fused = _STORED_FUSED if family.gguf_tensors == "fused" else _FUSED
    if family.gguf_tensors == "oai":
        layer_names = {**layer_names, **_OAI_NAMES}
    if family.experts is not None:
        layer_names, fused = {**layer_names, **_ROUTER}, {**fused, **_SHARED_FUSED}
    return layer_names, fused


# GGUF type -> the quantized format its weights keep under `--quantization auto`
NATIVE_FORMATS = {
    "Q4_0": QuantFormat(4, False), "Q4_1": QuantFormat(4, True), "Q4_K": QuantFormat(4, True, superblocks=True),
    "Q8_0": QuantFormat(8, False), "Q5_0": QuantFormat(8, False), "Q5_1": QuantFormat(8, False),
    "Q5_K": QuantFormat(5, True, superblocks=True), "Q6_K": QuantFormat(6, False, superblocks=True),
    "Q3_K": QuantFormat(3, False, superblocks=True), "Q2_K": QuantFormat(2, True, superblocks=True),
    "IQ4_NL": QuantFormat(4, False, codebook=True), "IQ4_XS": QuantFormat(4, False, superblocks=True, codebook=True),
    "MXFP4": QuantFormat(4, False, codebook=True, e8m0=True),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
HALF_TYPES = ("F16", "BF16")  # kept as stored in `auto` (2-D tensors; vectors become F32)
_REQUANTIZED_FORMATS = {"int4": QuantFormat(4, True), "int8": QuantFormat(8, False)}


def cache_key(path: Path, quantization: str = "auto") -> str:
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_HASHED_PREFIX_BYTES))
    h.update(f"{st.st_size}:{st.st_mtime_ns}:{CONVERT_VERSION}:{quantization}".encode())
    return h.hexdigest()[:16]


def converted_dir(cache_root: Path, gguf_path: Path, quantization: str = "auto") -> Path:
    return cache_root / "converted" / f"{gguf_path.stem}-{quantization}-{cache_key(gguf_path, quantization)}"


def open_gguf(path: Path) -> GGUFFile:
    return GGUFFile(path)


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    return reader.metadata


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16_column(head: np.ndarray, start: int, rows: int) -> np.ndarray:
    """[n blocks, head bytes] -> [rows, n / rows] float16 stored at byte `start` of each block's head."""
    return np.ascontiguousarray(head[:, start:start + 2]).view(np.float16).reshape(rows, -1)


def _repack_legacy(raw: np.ndarray, rows: int, cols: int, qtype: str) -> dict[str, np.ndarray]:
    """Q4_0 / Q4_1 / Q8_0 bytes -> qweight/scales(/mins) by slicing: GGUF's nibble order is ours."""
    header = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[qtype]
    payload = QK // 2 if qtype != "Q8_0" else QK
    head, weights = repack.split_blocks(raw, header + payload, header)
    out = {"qweight": weights.reshape(rows, -1), "scales": _f16_column(head, 0, rows)}
    if qtype == "Q8_0":
        out["qweight"] = out["qweight"].view(np.int8)
    if qtype == "Q4_1":
        out["mins"] = _f16_column(head, 2, rows)
    return out


def _repack_q4_k(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Q4_K super-blocks of 256 -> int4 blocks of 32 with scale d*sc and offset -dmin*mn (float16)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 2 + 2 + 12 + QK_K // 2)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _k_scales_mins(blocks[:, 4:16])  # [n, 8] each
    return {"qweight": repack.k4_codes(blocks, 16).reshape(rows, cols // 2),
            "scales": (d * sc).astype(np.float16).reshape(rows, cols // QK),
            "mins": (-(dmin * mn)).astype(np.float16).reshape(rows, cols // QK)}


def _k_super_scales(blocks: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Q4_K/Q5_K super-blocks' scales as stored: each row's d and dmin per super-block (float16) and each
    block's 6-bit sc and mn (uint8 [rows, cols/32, 2])."""
    d, dmin, sub = repack.k4_scales(blocks)
    return {"scales": d.reshape(rows, cols // QK_K), "mins": dmin.reshape(rows, cols // QK_K),
            "subscales": sub.reshape(rows, cols // QK, 2)}


def _repack_q4_k_super(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Q4_K super-blocks of 256 kept as stored, in brisk's row layout before tiling: int4 blocks of 32
    and the super-block scales (`_k_super_scales`); bytes move, no value is recomputed
    (brisk.kernels.tile_superblocks)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 2 + 2 + 12 + QK_K // 2)
    return {"qweight": repack.k4_codes(blocks, 16).reshape(rows, cols // 2), **_k_super_scales(blocks, rows, cols)}


def _repack_q5_k_super(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Q5_K super-blocks of 256 kept as stored, in brisk's row layout before tiling: 5-bit values (uint8
    [rows, cols]) and the super-block scales as Q4_K's (brisk.kernels.tile_int5)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, Q5_K_BYTES)
    return {"qweight": repack.k_quant_values(blocks, 5).reshape(rows, cols), **_k_super_scales(blocks, rows, cols)}


def _repack_signed(raw: np.ndarray, rows: int, cols: int, bits: int) -> dict[str, np.ndarray]:
    """Q6_K/Q3_K super-blocks of 256 (bits 6/3) kept as stored, in brisk's row layout before tiling: their
    values (uint8 [rows, cols]), each row's d per super-block (float16) and a signed sc per 16 weights (int8
    [rows, cols/32, 2]); bytes move, no value is recomputed (brisk.kernels.tile_int6 / tile_int3)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, Q6_K_BYTES if bits == 6 else Q3_K_BYTES)
    sc, d = (q6_k_scales if bits == 6 else q3_k_scales)(blocks)
    return {"qweight": repack.k_quant_values(blocks, bits).reshape(rows, cols), "scales": d.reshape(rows, cols // QK_K),
            "subscales": np.ascontiguousarray(sc).reshape(rows, cols // QK, 2)}


def _repack_q2_k_super(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """Q2_K super-blocks of 256 kept as stored, in brisk's row layout before tiling: 2-bit values (uint8
    [rows, cols]), each row's d and dmin per super-block (float16) and the file's byte per 16 weights, sc | mn << 4
    (uint8 [rows, cols/32, 2]); bytes move, no value is recomputed (brisk.kernels.tile_int2)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, Q2_K_BYTES)
    scales, d, dmin = q2_k_scales(blocks)
    return {"qweight": repack.k_quant_values(blocks, 2).reshape(rows, cols), "scales": d.reshape(rows, cols // QK_K),
            "mins": dmin.reshape(rows, cols // QK_K),
            "subscales": np.ascontiguousarray(scales).reshape(rows, cols // QK, 2)}


def _repack_iq4_nl(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """IQ4_NL blocks of 32 kept as stored, in brisk's int4 row layout before tiling: the 4-bit codes by
    slicing (Q4_0's nibble order) and the float16 d per block."""
    head, codes = repack.split_blocks(raw, 2 + QK // 2, 2)
    return {"qweight": codes.reshape(rows, -1), "scales": _f16_column(head, 0, rows)}


def _repack_iq4_xs(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """IQ4_XS super-blocks of 256 kept as stored, in brisk's int4 row layout before tiling: the codes by slicing
    (16 bytes per 32 in Q4_0's nibble order), each row's float16 d per 256 and the signed sc per 32 (int8
    [rows, cols/32, 1]: the file's 6-bit scale - 32, low 4 bits in scales_l, top 2 in scales_h)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, IQ4_XS_BYTES)
    high = blocks[:, 2:4].copy().view(np.uint16)[:, :1] >> (2 * np.arange(8, dtype=np.uint16))  # [n, 8]
    low = blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # [n, 4, 2]: sub-block 2i, 2i + 1
    sc = (low.reshape(-1, 8) & 0x0F) | ((high & 3).astype(np.uint8) << 4)
    return {"qweight": np.ascontiguousarray(blocks[:, 8:]).reshape(rows, -1),
            "scales": blocks[:, 0:2].copy().view(np.float16).reshape(rows, cols // QK_K),
            "subscales": (sc.astype(np.int16) - 32).astype(np.int8).reshape(rows, cols // QK, 1)}


def _repack_mxfp4(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """MXFP4 blocks of 32 kept as stored, in brisk's int4 row layout before tiling: the E2M1 codes by slicing
    (Q4_0's nibble order) and the E8M0 byte per block."""
    head, codes = repack.split_blocks(raw, 1 + QK // 2, 1)
    return {"qweight": codes.reshape(rows, -1), "scales": head.reshape(rows, cols // QK)}


_SUPER_REPACKS = {"MXFP4": _repack_mxfp4, "Q4_K": _repack_q4_k_super, "Q5_K": _repack_q5_k_super,
                  "Q6_K": lambda raw, rows, cols: _repack_signed(raw, rows, cols, 6),
                  "Q3_K": lambda raw, rows, cols: _repack_signed(raw, rows, cols, 3),
                  "Q2_K": _repack_q2_k_super, "IQ4_NL": _repack_iq4_nl, "IQ4_XS": _repack_iq4_xs}


def _with_format(arrays: dict[str, np.ndarray], fmt: QuantFormat) -> dict[str, np.ndarray]:
    """int4 blocks without offsets given offsets (-8 * scale, exact in float16) when `fmt` has them."""
    if fmt.has_mins and "mins" not in arrays:
        arrays["mins"] = (arrays["scales"].astype(np.float32) * -8).astype(np.float16)
    return arrays


def stored_arrays(fmt: QuantFormat | None, float_type: str = "F32") -> list[tuple[str, str]]:
    """(suffix, safetensors dtype) of the tensors a weight is stored as (`float_type`: F32, or F16/BF16
    for a 16-bit matrix kept as stored)."""
    if fmt is None:
        return [("weight", float_type)]
    arrays = [("qweight", "I8" if fmt.bits == 8 else "U8"), ("scales", "U8" if fmt.e8m0 else "F16")]
    signed = fmt.bits in SIGNED_OFFSETS or fmt.codebook
    return arrays + ([("mins", "F16")] if fmt.has_mins else []) + \
        ([("subscales", "I8" if signed else "U8")] if fmt.superblocks else []) + \
        ([(CODEBOOK, "I8")] if fmt.codebook else [])


def stored_shape(suffix: str, rows: int, cols: int, fmt: QuantFormat | None) -> tuple[int, ...]:
    if suffix == "weight":
        return (rows, cols)
    if suffix == CODEBOOK:
        return (len(IQ4_VALUES),)
    if fmt.superblocks:  # always tiled (a weight that cannot be is stored without them)
        return {"qweight": (rows // TILE_ROWS, cols // QK, TILE_BYTES[fmt.bits]),
                "subscales": (rows // TILE_ROWS, cols // QK, 8 if fmt.codebook else 16)
                }.get(suffix, (rows // TILE_ROWS, cols // QK_K, TILE_ROWS))
    if fmt.tiled:
        return (rows // TILE_ROWS, cols // QK, TILE_BYTES[fmt.bits] if suffix == "qweight" else TILE_ROWS)
    if suffix == "qweight":
        return (rows, cols // 2 if fmt.bits == 4 else cols)
    return (rows, cols // QK)


def target_format(name: str, qtype: str, shape: tuple[int, ...], quantization: str) -> QuantFormat | None:
    """How a tensor is stored: None = float32, else its quantized format."""
    if len(shape) != 2 or quantization == "none" or name.endswith(".bias"):  # (gpt-oss's experts' biases are 2-D)
        return None
    if quantization in _REQUANTIZED_FORMATS:
        check_quantizable(name, shape, quantization)
        return _REQUANTIZED_FORMATS[quantization]
    return None if qtype in FLOAT_TYPES else NATIVE_FORMATS[qtype]


def kept_type(qtype: str, shape: tuple[int, ...], quantization: str) -> str:
    """The safetensors type a float tensor is converted to: F16/BF16 for a 16-bit matrix, which `auto`
    keeps as stored, else F32."""
    return qtype if quantization == "auto" and qtype in HALF_TYPES and len(shape) == 2 else "F32"


def linear_types(path: Path) -> set[str]:
    """From the GGUF header alone, what the loader reads from the checkpoint `auto` converts it to:
    the types of the layers' matrices (the `*_proj.weight` tensors), plus the type of any quantized
    tensor (its blocks, wherever it is). {"BF16"} or {"F16"} means every linear stays 16-bit."""
    types = set()
    for t in read_gguf_header(path).tensors:
        if t.type_name not in FLOAT_TYPES:
            types.add(t.type_name)
        elif t.name.startswith("blk.") and len(t.shape) in (2, 3) and ".ffn_gate_inp" not in t.name:
            # (a router stays float32 as llama.cpp keeps it; stacked experts are [out, in] weights each)
            types.add(kept_type(t.type_name, t.shape[-2:], "auto"))
    return types


class _Tensors:
    """GGUF tensors in HF orientation ([out, in]): dequantized to float32, or kept as quantized blocks."""

    def __init__(self, reader: GGUFFile, config: dict[str, Any], source: str, quantization: str):
        self.reader = reader
        self.by_name = {t.name: t for t in reader.tensors}
        self.slices: dict[str, TensorInfo] = {}  # experts' [out, in] slices of 3-D tensors (`expert_slices`)
        self.config = config
        self.source = source
        self.quantization = quantization
        self.family = FAMILIES[config["architectures"][0]]
        self.permute = self.family.gguf_permuted

    def info(self, name: str) -> TensorInfo:
        return self.by_name[name] if name in self.by_name else self.slices[name]

    def expert_slices(self, name: str) -> list[str]:
        """The names of each expert's [out, in] slice of a stacked 3-D tensor (its bytes, expert by expert)."""
        t = self.by_name[name]
        if len(t.dims) != 3 or t.nbytes is None:
            raise ModelLoadError(f"{self.source}: expert tensor {name} has shape {list(t.shape)}; brisk reads experts "
                                 "stacked in one 3-D tensor (experts x out x in)")
        experts, each = t.dims[2], t.nbytes // t.dims[2]
        names = []
        for e in range(experts):
            names.append(f"{name}{EXPERT_MARK}{e}")
            self.slices[names[-1]] = TensorInfo(names[-1], t.type_name, t.dims[:2], t.offset + e * each, each)
        return names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def qtype(self, name: str) -> str:
        return check_type(self.source, name, self.info(name).type_name)

    def target_format(self, name: str) -> QuantFormat | None:
        return target_format(name, self.qtype(name), self.shape(name), self.quantization)

    def _unpermuted(self, name: str, values: np.ndarray) -> np.ndarray:
        if self.permute and name.endswith(("attn_q.weight", "attn_q.bias")):
            return _unpermute(values, self.config["num_attention_heads"])
        if self.permute and name.endswith(("attn_k.weight", "attn_k.bias")):
            return _unpermute(values, self.config["num_key_value_heads"])
        return values

    def load(self, name: str) -> np.ndarray:
        values = DEQUANTIZERS[self.qtype(name)](self.reader.data(self.info(name))).reshape(self.shape(name))
        return self._unpermuted(name, values)

    def kept_type(self, name: str) -> str:
        return kept_type(self.qtype(name), self.shape(name), self.quantization)

    def load_raw16(self, name: str) -> np.ndarray:
        """A 16-bit tensor's stored bits (float16, or bfloat16 as uint16), unpermuted like `load`."""
        raw = np.ascontiguousarray(self.reader.data(self.info(name)))
        values = raw.view(np.float16 if self.qtype(name) == "F16" else np.uint16).reshape(self.shape(name))
        return self._unpermuted(name, values)

    def load_as(self, name: str, fmt: QuantFormat | None) -> dict[str, np.ndarray]:
        """The tensor's arrays in `fmt` (suffix -> array), repacked without float when possible."""
        if fmt is None:
            return {"weight": self.load(name)}
        qtype, (rows, cols) = self.qtype(name), self.shape(name)
        raw = self.reader.data(self.info(name))
        if qtype in ("Q4_0", "Q4_1", "Q8_0") and NATIVE_FORMATS[qtype].bits == fmt.bits and \
                (fmt.has_mins or not NATIVE_FORMATS[qtype].has_mins):
            arrays = _with_format(_repack_legacy(raw, rows, cols, qtype), fmt)
        elif qtype in _SUPER_REPACKS and fmt == NATIVE_FORMATS[qtype]:
            arrays = _SUPER_REPACKS[qtype](raw, rows, cols)
        elif qtype == "Q4_K" and fmt == replace(NATIVE_FORMATS[qtype], superblocks=False):
            arrays = _repack_q4_k(raw, rows, cols)
        else:  # requantize from the float values
            method = "int4" if fmt.bits == 4 else "int8"
            quantized = QUANTIZERS[method](torch.from_numpy(np.ascontiguousarray(self.load(name))))
            return {k: v.numpy() for k, v in quantized.items()}
        return {k: self._unpermuted(name, v) for k, v in arrays.items()}


class _Group:
    """One output weight (possibly fused from several GGUF tensors), produced once for all its arrays."""

    def __init__(self, tensors: _Tensors, parts: list[str], hf_name: str, role: str | None = None):
        """`role`: the name whose kind decides the layout (a stacked projection's part: the projection's)."""
        self.tensors, self.parts = tensors, parts
        formats = [tensors.target_format(p) for p in parts]
        # NOTE: fused parts share one format; quantized ones that differ (a Q4_K q/k with a Q6_K v)
        # were split into parts before (`_stacked_parts`); a float part beside quantized ones makes
        # them all int8, the widest, so nothing loses precision it had.
        fmt = formats[0] if all(f == formats[0] for f in formats) else QuantFormat(8, False)
        kept = {tensors.kept_type(p) for p in parts}
        self.float_type = kept.pop() if fmt is None and len(kept) == 1 else "F32"  # fused parts share one type
        shapes = [tensors.shape(p) for p in parts]
        self.shape = (sum(s[0] for s in shapes), *shapes[0][1:])
        if tileable(role or hf_name, fmt, self.shape[0]):
            fmt = replace(fmt, tiled=True)
        elif fmt is not None and fmt.codebook:  # iq4 lives in tiles only: int8, within half its step
            fmt = QuantFormat(8, False)
        elif fmt is not None and fmt.superblocks:  # super-block scales live in tiles only: Q4_K becomes
            fmt = replace(fmt, superblocks=False) if fmt.bits == 4 else QuantFormat(8, False)  # int4, Q2/3/5/6_K int8
        self.fmt = fmt
        self._arrays: dict[str, np.ndarray] | None = None

    def take(self, suffix: str) -> np.ndarray | list[np.ndarray]:
        """The array stored as `suffix`, or its pieces to write one after the other (rows of tiles, by part)."""
        if self._arrays is None:
            plain = replace(self.fmt, tiled=False) if self.fmt else self.fmt
            if self.fmt is not None and self.fmt.tiled and self.fmt.bits != 16 and \
                    all(self.tensors.shape(p)[0] % TILE_ROWS == 0 for p in self.parts):
                # a tile holds 8 rows of one part, so the tiles of the parts one after the other are those
                # of the fused weight: tiled part by part, nothing is copied to stack them
                tiled = [self._tiled(self.tensors.load_as(p, plain)) for p in self.parts]
                self._arrays = {k: tiled[0][k] if k == CODEBOOK else [t[k] for t in tiled] for k in tiled[0]}
            else:
                loaded = [{"weight": self.tensors.load_raw16(p)} if self.float_type != "F32" else
                          self.tensors.load_as(p, plain) for p in self.parts]
                arrays = {k: _rows_of([a[k] for a in loaded]) for k in loaded[0]}
                self._arrays = self._tiled(arrays) if self.fmt is not None and self.fmt.tiled else arrays
        return self._arrays.pop(suffix)  # each array is written once; memory is freed as we go

    def _tiled(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.fmt.codebook:  # the table the codes stand for, once per weight
            arrays[CODEBOOK] = np.array(MXFP4_VALUES if self.fmt.e8m0 else IQ4_VALUES, dtype=np.int8)
        tiled = tile({k: torch.from_numpy(v) for k, v in arrays.items()}, self.fmt.bits)
        return {k: v.numpy() for k, v in tiled.items()}


def _rows_of(parts: list[np.ndarray]) -> np.ndarray:
    """The parts of a fused weight one above the other; a lone part as it is when it is our own contiguous array
    (a view of the GGUF's read-only map is copied, as concatenating would)."""
    if len(parts) == 1 and parts[0].flags.writeable and parts[0].flags.c_contiguous:
        return parts[0]
    return np.concatenate(parts, axis=0)


def _groups(tensors: _Tensors, num_layers: int) -> list[tuple[str, list[str]]]:
    """(output name, GGUF tensors it is made of) for every weight of the converted checkpoint."""
    groups: list[tuple[str, list[str]]] = []
    for gguf_name, hf_name in _PLAIN_NAMES.items():
        if gguf_name in tensors.by_name:
            groups.append((hf_name, [gguf_name]))
    layer_names, fused = _names_of(tensors.family)
    for i in range(num_layers):
        prefix = f"blk.{i}."
        for hf_part, parts in fused.items():
            names = [prefix + p for p in parts]
            present = [n in tensors.by_name for n in names]
            if not any(present):
                continue
            if not all(present):
                missing = [n for n, p in zip(names, present) if not p]
                raise ModelLoadError(f"{tensors.source}: GGUF lacks tensor(s) {', '.join(missing)}")
            groups.append((f"model.layers.{i}.{hf_part}", names))
        taken = {n for _, names in groups for n in names}
        for part, hf_part in layer_names.items():
            if prefix + part in tensors.by_name and prefix + part not in taken:
                groups.append((f"model.layers.{i}.{hf_part}", [prefix + part]))
    return groups


def _expert_groups(tensors: _Tensors, num_layers: int) -> list[tuple[str, list[str]]]:
    """(output name, 3-D GGUF tensors it is made of) for the stacked experts of every MoE layer."""
    groups = []
    for i in range(num_layers):
        prefix = f"blk.{i}."
        for hf_part, parts in EXPERT_TENSORS.items():
            names = [prefix + p for p in parts]
            present = [n in tensors.by_name for n in names]
            if any(present) and not all(present):
                raise ModelLoadError(f"{tensors.source}: GGUF lacks tensor(s) "
                                     f"{', '.join(n for n, p in zip(names, present) if not p)}")
            if all(present):
                groups.append((f"model.layers.{i}.{hf_part}", names))
        if tensors.family.experts is not None and f"{prefix}ffn_gate_inp.weight" in tensors.by_name and \
                not any(g[0].startswith(f"model.layers.{i}.") for g in groups):
            raise ModelLoadError(f"{tensors.source}: layer {i} has a router but its experts are not stacked in "
                                 "ffn_{gate,up,down}_exps tensors (an expert-sharded GGUF from an old converter); "
                                 "convert the model again with a current llama.cpp")
    return groups


def _expert_plan(tensors: _Tensors, hf_name: str, names: list[str]
                 ) -> list[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """A stacked expert projection: each expert's slices fused and stored as a dense weight's would be, the
    experts one after the other (a leading expert dimension on every array)."""
    per_expert = list(zip(*(tensors.expert_slices(n) for n in names)))  # [(gate#e, up#e) for each expert e]
    plan = []
    runs = _stacked_parts(tensors, hf_name, list(per_expert[0]))  # the same types for every expert
    for index, (run_name, first_parts) in enumerate(runs):
        columns = [list(per_expert[0]).index(part) for part in first_parts]
        groups = [_Group(tensors, [parts[c] for c in columns], run_name, role=hf_name) for parts in per_expert]
        base, lead = run_name.removesuffix(".weight"), groups[0]
        for suffix, dtype in stored_arrays(lead.fmt, lead.float_type):
            name = run_name if suffix == "weight" else f"{base}.{suffix}"
            if suffix == CODEBOOK:  # one table per stacked weight: the first expert's
                plan.append((name, dtype, (len(IQ4_VALUES),), lambda gs=groups: _first_codebook(gs)))
                continue
            shape = (len(groups), *stored_shape(suffix, *lead.shape, lead.fmt))
            plan.append((name, dtype, shape, lambda gs=groups, sf=suffix: _pieces(g.take(sf) for g in gs)))
    return plan


def _first_codebook(groups: list["_Group"]) -> np.ndarray:
    tables = [g.take(CODEBOOK) for g in groups]
    return tables[0]


def _pieces(arrays) -> list[np.ndarray]:
    """Arrays and lists of arrays, flattened into the pieces to write one after the other."""
    out: list[np.ndarray] = []
    for a in arrays:
        out.extend(a if isinstance(a, list) else [a])
    return out


def _stacked_parts(tensors: _Tensors, hf_name: str, parts: list[str]) -> list[tuple[str, list[str]]]:
    """A fused weight whose GGUF tensors are quantized in different types (a Q4_K_M layer's Q4_K
    attn_q/attn_k and Q6_K attn_v) -> its runs of one format, each stored as its own part,
    `name.parts.{i}.*` (brisk.models.quant.StackedQuantLinear), so that every part keeps its type as
    stored; else the weight as one group."""
    formats = [tensors.target_format(p) for p in parts]
    if len(parts) < 2 or None in formats or all(f == formats[0] for f in formats):
        return [(hf_name, parts)]
    runs: list[list[str]] = []
    for i, part in enumerate(parts):
        if i and formats[i] == formats[i - 1]:
            runs[-1].append(part)
        else:
            runs.append([part])
    base = hf_name.removesuffix(".weight")
    return [(f"{base}{PARTS}{i}.weight", run) for i, run in enumerate(runs)]


def _plan(tensors: _Tensors, groups: list[tuple[str, list[str]]], expert_groups: list[tuple[str, list[str]]] = ()
          ) -> list[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(output name, safetensors dtype, shape, producer) for every tensor of the converted checkpoint."""
    plan = []
    for fused_name, fused_parts in groups:
        for hf_name, parts in _stacked_parts(tensors, fused_name, fused_parts):
            plan += _group_plan(_Group(tensors, parts, hf_name, role=fused_name), hf_name)
    for hf_name, names in expert_groups:
        plan += _expert_plan(tensors, hf_name, names)
    return plan


def _group_plan(group: _Group, hf_name: str) -> list[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]]:
    plan = []
    base = hf_name.removesuffix(".weight")
    for suffix, dtype in stored_arrays(group.fmt, group.float_type):
        name = hf_name if suffix == "weight" else f"{base}.{suffix}"
        shape = group.shape if len(group.shape) == 1 else stored_shape(suffix, *group.shape, group.fmt)
        plan.append((name, dtype, shape, lambda g=group, s=suffix: g.take(s)))
    return plan


ROPE_FREQS = "rope_freqs.weight"
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
_ROPE_TENSORS = (ROPE_FREQS, ROPE_LONG, ROPE_SHORT)


def _read_rope_factors(tensors: _Tensors, config: dict[str, Any]) -> None:
    """RoPE scaling that llama.cpp's converter stores as tensors: Llama 3.1+'s llama3 scaling as
    per-frequency divisors, Phi-3's LongRoPE as its short and long factors."""
    if ROPE_FREQS in tensors.by_name:
        config["rope_freq_factors"] = [float(f) for f in tensors.load(ROPE_FREQS).reshape(-1)]
    if ROPE_LONG in tensors.by_name or ROPE_SHORT in tensors.by_name:
        factors = {k: [float(f) for f in tensors.load(name).reshape(-1)] for k, name in
                   (("long_factor", ROPE_LONG), ("short_factor", ROPE_SHORT)) if name in tensors.by_name}
        if len(factors) < 2:
            raise ModelLoadError(f"{tensors.source}: GGUF has only one of {ROPE_LONG} and {ROPE_SHORT}")
        config["rope_scaling"] = {
            "rope_type": "longrope", **factors, "rope_theta": config["rope_theta"],
            "original_max_position_embeddings": config.get("original_max_position_embeddings",
                                                           config["max_position_embeddings"]),
            "attention_factor": config.pop("brisk_rope_attention_factor", None)}


def _mark_dense_layers(tensors: _Tensors, config: dict[str, Any]) -> None:
    """An MoE GGUF's layers without a router are dense: config.json lists them as transformers does
    (mlp_only_layers)."""
    if tensors.family.experts is None:
        return
    dense = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors.by_name]
    if dense:
        config["mlp_only_layers"] = dense


def _check_all_tensors_used(tensors: _Tensors, groups: list[tuple[str, list[str]]]) -> None:
    """A tensor the model does not read would leave it silently wrong (as `rope_freqs.weight` once
    did): refuse the file, naming it, before anything is written."""
    used = set(_ROPE_TENSORS) | {part for _, parts in groups for part in parts}
    unused = sorted(set(tensors.by_name) - used)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ModelLoadError(f"{tensors.source}: GGUF tensor(s) {shown} are not read by brisk's "
                             f"{tensors.config['architectures'][0]}; running without them would give wrong "
                             "answers, so the model is refused")


_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8, "I8": np.int8}  # BF16: bits


def _write_pieces(f, pieces: list[np.ndarray]) -> None:
    for p in pieces:
        f.write(p.reshape(-1).view(np.uint8))


def header_blob(plan, metadata: dict[str, str]) -> tuple[bytes, int]:
    """A planned checkpoint's safetensors header (its 8-byte length first, padded so tensor data stays 8-byte
    aligned) and its data's size in bytes: the file is the header, then each tensor in turn."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, _ in plan:
        nbytes = int(np.prod(shape)) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offset


def stream_tensors(f, plan, label: str, overlap: bool = True) -> None:
    """Produce every planned tensor and write its bytes to `f` (anything with `write`), in order. With `overlap`
    (a file), one thread writes a tensor while this one produces the next (file writes and numpy's loops drop the
    GIL): at most two tensors are held at once. Without (a copy into memory), the copy follows the production:
    a third thread beside the kernels' two OpenMP ones on 2 cores made the whole 2.4x slower."""
    from brisk.progress import Progress

    with Progress(label, len(plan)) as progress, \
            ThreadPoolExecutor(1, thread_name_prefix="brisk-convert-write") as writer:
        writing = None
        for name, dtype, shape, produce in plan:
            progress.advance()
            produced = produce()
            pieces = [np.ascontiguousarray(p, dtype=_NUMPY_DTYPES[dtype])
                      for p in (produced if isinstance(produced, list) else [produced])]
            # pieces are a weight's rows in runs, or (stacked experts) each expert's arrays in turn: their
            # trailing dimensions are the tensor's, and together they hold all of its elements
            trailing = [tuple(shape[len(shape) - p.ndim + 1:]) if p.ndim > 1 else () for p in pieces]
            if sum(p.size for p in pieces) != int(np.prod(shape)) or \
                    any(p.shape[1:] != t for p, t in zip(pieces, trailing)):
                raise ModelLoadError(f"tensor {name}: expected shape {shape}, got {[p.shape for p in pieces]}")
            if not overlap:
                _write_pieces(f, pieces)
                continue
            if writing is not None:
                writing.result()
            writing = writer.submit(_write_pieces, f, pieces)
        if writing is not None:
            writing.result()


def conversion_label(folder: Path) -> str:
    return f"converting {folder.name.split(TEMP_MARK)[0].lstrip('.')}: tensors"


def _write_safetensors(path: Path, plan, metadata: dict[str, str]) -> int:
    """Stream tensors into a safetensors file: header first, then each tensor in turn."""
    head, size = header_blob(plan, metadata)
    with open(path, "wb") as f:
        f.write(head)
        stream_tensors(f, plan, conversion_label(path.parent))
    return size


def prepare(gguf_path: Path, out_dir: Path, quantization: str):
    """What a conversion writes, planned from the GGUF: (config, tokenizer, its config, the tensor plan, timings)."""
    import time

    t0 = time.perf_counter()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(out_dir.parent)  # left by a conversion that was killed (even by SIGKILL)
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    source = str(gguf_path)
    config = hf_config(meta, has_output="output.weight" in {t.name for t in reader.tensors}, source=source)
    fast_tokenizer, tok_config = build_tokenizer(meta, source)
    tensors = _Tensors(reader, config, source, quantization)
    groups = _groups(tensors, config["num_hidden_layers"])
    expert_groups = _expert_groups(tensors, config["num_hidden_layers"])
    _check_all_tensors_used(tensors, groups + expert_groups)
    _read_rope_factors(tensors, config)
    _mark_dense_layers(tensors, config)
    plan = _plan(tensors, groups, expert_groups)
    return config, fast_tokenizer, tok_config, plan, {"gguf_read": (time.perf_counter() - t0) * 1e3}


SAFETENSORS_METADATA = {"format": "pt", "brisk_layout": BRISK_LAYOUT}


def temp_folder(out_dir: Path) -> tuple[Path, int]:
    """A new temporary folder beside `out_dir` and the lock that marks it alive (held until the folder is
    renamed into place or this process ends; `remove_stale_temp_dirs` removes one whose lock is free)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}{TEMP_MARK}", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    return tmp, _hold_lock(tmp)


def write_small_files(tmp: Path, gguf_path: Path, config, fast_tokenizer, tok_config, quantization: str) -> None:
    """config.json, the tokenizer's files and brisk_source.json of a converted folder."""
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok_config["model_max_length"] = config["max_position_embeddings"]
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False), encoding="utf-8")
    fast_tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "brisk_source.json").write_text(json.dumps(
        {"gguf": str(gguf_path), "size": gguf_path.stat().st_size, "convert_version": CONVERT_VERSION,
         "quantization": quantization}, indent=2))


def publish(tmp: Path, out_dir: Path) -> bool:
    """The finished folder renamed into place (atomic: a reader sees all of it or nothing). False when another
    process finished the same conversion first (its folder is kept, this one removed)."""
    try:
        os.rename(tmp, out_dir)
        (out_dir / LOCK_NAME).unlink(missing_ok=True)
        return True
    except OSError:
        if not (out_dir / "config.json").exists():  # not a concurrent winner: a real failure
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def convert(gguf_path: Path, out_dir: Path, quantization: str = "auto") -> dict[str, float]:
    """Convert `gguf_path` into `out_dir` (created atomically). Returns phase timings in ms."""
    import time

    config, fast_tokenizer, tok_config, plan, timings = prepare(gguf_path, out_dir, quantization)
    tmp, lock = temp_folder(out_dir)
    try:
        t1 = time.perf_counter()
        _write_safetensors(tmp / "model.safetensors", plan, SAFETENSORS_METADATA)
        timings["dequantize_write"] = (time.perf_counter() - t1) * 1e3
        write_small_files(tmp, gguf_path, config, fast_tokenizer, tok_config, quantization)
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return timings


TEMP_MARK = ".tmp-"
LOCK_NAME = ".converting.lock"
_LOCKLESS_GRACE_S = 60.0  # a folder made by mkdtemp a moment ago may not hold its lock yet


def _hold_lock(folder: Path) -> int:
    import fcntl

    fd = os.open(folder / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_stale_temp_dirs(parent: Path) -> list[Path]:
    """Remove conversion temp folders whose converting process is gone (killed mid-write, even
    by SIGKILL: the kernel drops its lock). A folder whose lock is held is a conversion still
    running, in this or another process, and is left alone. Returns what was removed."""
    import fcntl
    import time

    removed = []
    for folder in parent.glob(f".*{TEMP_MARK}*"):
        if not folder.is_dir():
            continue
        lock_path = folder / LOCK_NAME
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:  # no lock: stale once past the moment between mkdtemp and locking
            if time.time() - folder.stat().st_mtime < _LOCKLESS_GRACE_S:
                continue
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live conversion
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            log.info("removed %s, left by a conversion that did not finish", folder)
        finally:
            if fd is not None:
                os.close(fd)
    return removed

