"""MXFP4 as the Hub's gpt-oss checkpoints store it -> brisk's MXFP4 layout, kept at 4 bits.

The Hub's checkpoints (`quantization_config.quant_method: mxfp4`) hold each expert projection as
`*_blocks` uint8 [E, N, K/32, 16] (two E2M1 codes a byte, weight 2i in the low nibble and 2i + 1 in the
high one) and `*_scales` uint8 [E, N, K/32] (E8M0 exponents, biased by 127). brisk keeps the codes in
int4's tiles in GGUF's nibble order (weights j and j + 16 in byte j) with the scale bytes as they are,
which is bit for bit what a GGUF MXFP4 tensor converts to (brisk.loading.gguf_convert): the same
weights, 4.25 bits each. Nothing is widened to float.
"""

from __future__ import annotations

import torch

from brisk import kernels
from brisk.errors import ModelLoadError
from brisk.models.quant import CODEBOOK

_BLOCK_BYTES = kernels.QK // 2


def gguf_order(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes in the Hub's order (byte i: weights 2i, 2i + 1) -> GGUF's (byte j: weights j, j + 16)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., 32] in weight order
    return codes[..., :_BLOCK_BYTES] | (codes[..., _BLOCK_BYTES:] << 4)


def from_hub(blocks: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stacked experts' `*_blocks` [E, N, K/32, 16] and `*_scales` [E, N, K/32] -> brisk's tensors of that
    projection: qweight [E, N/8, K/32, 128], scales [E, N/8, K/32, 8] (uint8) and the codebook."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or \
            blocks.shape[-1] != _BLOCK_BYTES or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ModelLoadError(f"MXFP4 tensors of shapes {list(blocks.shape)} ({blocks.dtype}) and {list(scales.shape)} "
                             f"({scales.dtype}) are not the Hub's layout (uint8 [E, N, K/32, 16] and [E, N, K/32])")
    experts, rows, nb, _ = blocks.shape
    if rows % kernels.TILE_ROWS:
        raise ModelLoadError(f"an MXFP4 expert of {rows} rows cannot be kept packed: brisk's tiles hold "
                             f"{kernels.TILE_ROWS} rows")
    qweights, tiled_scales = [], []
    for e in range(experts):
        row_codes = gguf_order(blocks[e]).reshape(rows, nb * _BLOCK_BYTES)
        q, s, _ = kernels.tile_int4(row_codes.contiguous(), scales[e].contiguous(), None)
        qweights.append(q)
        tiled_scales.append(s)
    return {"qweight": torch.stack(qweights), "scales": torch.stack(tiled_scales),
            CODEBOOK: torch.tensor(kernels.MXFP4_VALUES, dtype=torch.int8)}
