"""The byte moves a GGUF conversion makes over every weight (`brisk.loading.gguf_convert`): the compiled
`brisk/kernels/repack.cpp` when the kernels are built, else the numpy functions of `brisk.loading.dequant`
they were written from, which tests/test_repack.py holds them to, byte for byte. Inputs are a tensor's
GGUF blocks as bytes, [super-blocks, bytes a block]."""

from __future__ import annotations

import numpy as np

from brisk import kernels
from brisk.loading.dequant import (Q2_K_BYTES, Q3_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K, k_scale_codes,
                                   nibbles_64_as_32s, q2_k_parts, q3_k_parts, q5_k_values, q6_k_parts)

# GGUF K-quant type, by its bits -> (bytes a super-block, numpy values of [n, bytes] blocks -> [n, 256])
_VALUES = {6: (Q6_K_BYTES, lambda b: q6_k_parts(b)[0]), 5: (Q5_K_BYTES, lambda b: q5_k_values(b).reshape(-1, QK_K)),
           3: (Q3_K_BYTES, lambda b: q3_k_parts(b)[0]), 2: (Q2_K_BYTES, lambda b: q2_k_parts(b)[0])}


def k_quant_values(blocks: np.ndarray, bits: int, compiled: bool = True) -> np.ndarray:
    """Q6_K/Q5_K/Q3_K/Q2_K super-blocks (by `bits`) [n, bytes] -> their values [n, 256] uint8, element order."""
    size, reference = _VALUES[bits]
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, size)
    lib = kernels.library() if compiled else None
    if lib is None:
        return reference(blocks)
    out = np.empty((blocks.shape[0], QK_K), dtype=np.uint8)
    if lib.brisk_k_quant_values(blocks.ctypes.data, bits, blocks.shape[0], out.ctypes.data):
        raise ValueError(f"no compiled values for {bits}-bit K-quants")
    return out


def k4_codes(blocks: np.ndarray, qs_offset: int, compiled: bool = True) -> np.ndarray:
    """Q4_K super-blocks [n, 144] (their 128 bytes of nibbles at `qs_offset`) -> [n, 8, 16]: each block of 32
    in Q4_0's nibble order (`nibbles_64_as_32s`)."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    lib = kernels.library() if compiled else None
    if lib is None:
        return nibbles_64_as_32s(blocks[:, qs_offset:qs_offset + QK_K // 2])
    out = np.empty((blocks.shape[0], 8, 16), dtype=np.uint8)
    lib.brisk_k4_codes(blocks.ctypes.data, blocks.shape[1], qs_offset, blocks.shape[0], out.ctypes.data)
    return out


def k4_scales(blocks: np.ndarray, compiled: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks [n, bytes] -> their scales as stored: d [n] and dmin [n] float16 and each block's
    6-bit sc and mn, uint8 [n, 8, 2]."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    lib = kernels.library() if compiled else None
    if lib is None:
        sc, mn = k_scale_codes(blocks[:, 4:16])
        return (blocks[:, 0:2].copy().view(np.float16)[:, 0], blocks[:, 2:4].copy().view(np.float16)[:, 0],
                np.stack([sc, mn], axis=-1))
    n = blocks.shape[0]
    d, dmin, sub = np.empty(n, np.float16), np.empty(n, np.float16), np.empty((n, 8, 2), np.uint8)
    lib.brisk_k4_scales(blocks.ctypes.data, blocks.shape[1], n, d.ctypes.data, dmin.ctypes.data, sub.ctypes.data)
    return d, dmin, sub


def split_blocks(blocks: np.ndarray, block_bytes: int, head_bytes: int, compiled: bool = True
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of `block_bytes` (Q4_0, Q4_1, Q8_0, IQ4_NL) -> their first `head_bytes` (the scales) [n, head_bytes]
    and the rest (the weights, GGUF's order kept) [n, block_bytes - head_bytes]."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, block_bytes)
    lib = kernels.library() if compiled else None
    if lib is None:
        return np.ascontiguousarray(blocks[:, :head_bytes]), np.ascontiguousarray(blocks[:, head_bytes:])
    n = blocks.shape[0]
    head, payload = np.empty((n, head_bytes), np.uint8), np.empty((n, block_bytes - head_bytes), np.uint8)
    lib.brisk_split_blocks(blocks.ctypes.data, block_bytes, head_bytes, n, head.ctypes.data, payload.ctypes.data)
    return head, payload
