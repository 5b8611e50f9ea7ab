"""Vectorized numpy dequantizers for the GGML block formats brisk reads from GGUF.

Each function takes the raw bytes of a tensor as a uint8 array whose size is a
multiple of the block size and returns float32 values in storage order. Layouts
follow ggml's block structs (`ggml-common.h`); results are checked against the
`gguf` package's own dequantizer in the tests.
"""

from __future__ import annotations

import numpy as np

from brisk.errors import ModelLoadError

QK = 32  # elements per block of the legacy formats
QK_K = 256  # elements per super-block of the k-quants


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size % block_bytes:
        raise ValueError(f"{raw.size} bytes is not a whole number of {block_bytes}-byte blocks")
    return raw.reshape(-1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """Column [n_blocks, 1] of the float16 stored at byte `start` of each block, as float32."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes holding 32 bits (little-endian) -> [n, 32] bits, bit j for element j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 2 + QK)
    return (_f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 2 + QK // 2)
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return (_f16(b, 0) * q.astype(np.float32)).reshape(-1)


def dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 4 + QK // 2)
    q = _nibbles(b[:, 4:]).astype(np.float32)
    return (_f16(b, 0) * q + _f16(b, 2)).reshape(-1)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return _nibbles(qs) | (_high_bits(qh) << 4)


def dequant_q5_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 2 + 4 + QK // 2)
    q = _q5_values(b[:, 2:6], b[:, 6:]).astype(np.int8) - np.int8(16)
    return (_f16(b, 0) * q.astype(np.float32)).reshape(-1)


def dequant_q5_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 4 + 4 + QK // 2)
    q = _q5_values(b[:, 4:8], b[:, 8:]).astype(np.float32)
    return (_f16(b, 0) * q + _f16(b, 2)).reshape(-1)


def k_scale_codes(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K -> two [n, 8] uint8 arrays."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`k_scale_codes` as float32."""
    sc, mn = k_scale_codes(scales)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quant_apply(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """q: [n, 8, 32] integer values of the 8 sub-blocks -> dequantized [n * 256]."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    scale = (d * sc)[:, :, None]
    offset = (dmin * mn)[:, :, None]
    return (scale * q.astype(np.float32) - offset).reshape(-1)


def _split_nibbles_64(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 8, 32]: each 32-byte chunk gives a low-nibble then a high-nibble sub-block."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)


def nibbles_64_as_32s(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes of 64-weight chunks (a chunk's 32 bytes: weights 0..31 in the low nibbles, 32..63 in
    the high) -> [n, 8, 16]: each block of 32 in Q4_0's nibble order (byte j: weight j | weight j + 16
    << 4), what `_split_nibbles_64` then `pack_int4` give, without unpacking: the low halves of bytes j and
    j + 16 of a chunk make its first block's byte j, their high halves the second's."""
    chunks = qs.reshape(-1, 4, 2, 16)  # [n, chunk, bytes 0..15 / 16..31, 16]
    first, second = chunks[:, :, 0], chunks[:, :, 1]
    return np.stack([(first & 0x0F) | (second << 4), (first >> 4) | (second & 0xF0)], axis=2).reshape(-1, 8, 16)


def dequant_q4_k(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 2 + 2 + 12 + QK_K // 2)
    return _k_quant_apply(b, _split_nibbles_64(b[:, 16:]))


Q5_K_BYTES = 2 + 2 + 12 + QK_K // 8 + QK_K // 2


def q5_k_values(b: np.ndarray) -> np.ndarray:
    """Q5_K blocks [n, 176] -> their 5-bit values [n, 8, 32] (sub-block, element)."""
    qh, qs = b[:, 16:48], b[:, 48:]
    low = _split_nibbles_64(qs)  # [n, 8, 32]
    bit_index = np.arange(8, dtype=np.uint8)[None, :, None]  # sub-block i uses bit i of qh
    high = (qh[:, None, :] >> bit_index) & 1  # [n, 8, 32]
    return low | (high << 4)


def dequant_q5_k(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, Q5_K_BYTES)
    return _k_quant_apply(b, q5_k_values(b))


Q6_K_BYTES = QK_K // 2 + QK_K // 4 + QK_K // 16 + 2


def q6_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K super-blocks -> (values [n, 256] uint8 in [0, 63], element order; sc [n, 16] int8, one per 16
    elements; d [n] float16). A weight is d * sc * (q - 32)."""
    b = _blocks(raw, Q6_K_BYTES)
    ql = b[:, :128].reshape(-1, 2, 2, 32)  # [n, half, (l, l+32), 32]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # [n, half, 1, 32]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, half, 4, 32] for q1, q2, q3, q4
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = (qh >> shifts) & 3  # [n, half, 4, 32]
    q = (low | (high << 4)).reshape(-1, QK_K)  # element l of quarter j: scale index j * 2 + l // 16
    return (q, *q6_k_scales(b))


def q6_k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks [n, 210] -> (sc [n, 16] int8, d [n] float16): `q6_k_parts`'s scales."""
    return b[:, 192:208].view(np.int8), b[:, 208:210].copy().view(np.float16)[:, 0]


def dequant_q6_k(raw: np.ndarray) -> np.ndarray:
    q, sc, d = q6_k_parts(raw)
    scale = d.astype(np.float32)[:, None, None] * sc.astype(np.float32).reshape(-1, 16, 1)
    return (scale * (q.astype(np.int8) - np.int8(32)).astype(np.float32).reshape(-1, 16, 16)).reshape(-1)


Q2_K_BYTES = QK_K // 16 + QK_K // 4 + 2 + 2


def q2_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K super-blocks -> (values [n, 256] uint8 in [0, 3], element order; scales [n, 16] uint8, one per
    16 elements: sc in the low nibble, mn in the high; d [n] and dmin [n] float16). A weight is
    d * sc * q - dmin * mn. Element 128h + 32j + l takes the 2 bits at 2j of qs[32h + l]."""
    b = _blocks(raw, Q2_K_BYTES)
    q = (b[:, 16:80].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    return (q.reshape(-1, QK_K), *q2_k_scales(b))


def q2_k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K super-blocks [n, 84] -> (scales [n, 16] uint8, d [n], dmin [n] float16): `q2_k_parts`'s scales."""
    return b[:, :16], b[:, 80:82].copy().view(np.float16)[:, 0], b[:, 82:84].copy().view(np.float16)[:, 0]


def dequant_q2_k(raw: np.ndarray) -> np.ndarray:
    q, scales, d, dmin = q2_k_parts(raw)
    step = (d.astype(np.float32)[:, None] * (scales & 0x0F).astype(np.float32))[..., None]
    shift = (dmin.astype(np.float32)[:, None] * (scales >> 4).astype(np.float32))[..., None]
    return (step * q.reshape(-1, 16, 16).astype(np.float32) - shift).reshape(-1)


Q3_K_BYTES = QK_K // 8 + QK_K // 4 + 12 + 2


def q3_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K super-blocks -> (values [n, 256] uint8 in [0, 7], element order; sc [n, 16] int8 in [-32, 31],
    one per 16 elements; d [n] float16). A weight is d * sc * (q - 4). Element 128h + 32j + l takes the
    2 bits at 2j of qs[32h + l] and, as its bit 2, bit 4h + j of hmask[l] (ggml's Q3_K subtracts 4 where
    that bit is clear); scale i's low 4 bits are nibble i // 8 of byte i % 8, its top 2 the bits at
    2 (i // 4) of byte 8 + i % 4."""
    b = _blocks(raw, Q3_K_BYTES)
    hmask, qs = b[:, :32], b[:, 32:96]
    low = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    top = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 4h + j, 32]
    q = (low.reshape(-1, 8, 32) | (top << 2)).reshape(-1, QK_K)
    return (q, *q3_k_scales(b))


def q3_k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K super-blocks [n, 110] -> (sc [n, 16] int8, d [n] float16): `q3_k_parts`'s scales."""
    packed = b[:, 96:108]
    i = np.arange(16)
    sc = ((packed[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F) | \
        (((packed[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3) << 4)
    return (sc.astype(np.int16) - 32).astype(np.int8), b[:, 108:110].copy().view(np.float16)[:, 0]


def dequant_q3_k(raw: np.ndarray) -> np.ndarray:
    q, sc, d = q3_k_parts(raw)
    scale = d.astype(np.float32)[:, None, None] * sc.astype(np.float32).reshape(-1, 16, 1)
    return (scale * (q.astype(np.int8) - np.int8(4)).astype(np.float32).reshape(-1, 16, 16)).reshape(-1)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
IQ4_XS_BYTES = 2 + 2 + QK_K // 64 + QK_K // 2


def dequant_iq4_nl(raw: np.ndarray) -> np.ndarray:
    """IQ4_NL: blocks of 32, a float16 d and 16 bytes of 4-bit codes (Q4_0's order) into IQ4_VALUES."""
    b = _blocks(raw, 2 + QK // 2)
    return (_f16(b, 0) * IQ4_VALUES[_nibbles(b[:, 2:])].astype(np.float32)).reshape(-1)


def dequant_iq4_xs(raw: np.ndarray) -> np.ndarray:
    """IQ4_XS: super-blocks of 256, a float16 d, 6-bit scales per 32 (low 4 bits in 4 bytes, top 2 in a
    uint16), codes as IQ4_NL's per 32: d * (scale - 32) * IQ4_VALUES[q]."""
    b = _blocks(raw, IQ4_XS_BYTES)
    high = b[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))  # [n, 8]
    low = (b[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 0x0F
    scale = ((low | ((high & 3).astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    step = (_f16(b, 0) * scale)[..., None]  # [n, 8, 1]
    codes = _nibbles(b[:, 8:].reshape(-1, QK // 2)).reshape(-1, 8, QK)
    return (step * IQ4_VALUES[codes].astype(np.float32)).reshape(-1)


MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)  # E2M1, doubled


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> 2^(e - 128) as float32 (gguf's e8m0_to_fp32_half: e < 2 are the float's subnormals)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


def dequant_mxfp4(raw: np.ndarray) -> np.ndarray:
    """MXFP4: blocks of 32, an E8M0 byte and 16 bytes of E2M1 codes (Q4_0's order): 2^(e - 128) * MXFP4_VALUES[q]."""
    b = _blocks(raw, 1 + QK // 2)
    return (e8m0_half(b[:, :1]) * MXFP4_VALUES[_nibbles(b[:, 1:])].astype(np.float32)).reshape(-1)


def dequant_f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(-1).view(np.float16).astype(np.float32)


def dequant_bf16(raw: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(raw).reshape(-1).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def dequant_f32(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(-1).view(np.float32)


DEQUANTIZERS = {
    "F32": dequant_f32,
    "F16": dequant_f16,
    "BF16": dequant_bf16,
    "Q8_0": dequant_q8_0,
    "Q4_0": dequant_q4_0,
    "Q4_1": dequant_q4_1,
    "Q5_0": dequant_q5_0,
    "Q5_1": dequant_q5_1,
    "Q2_K": dequant_q2_k,
    "Q3_K": dequant_q3_k,
    "Q4_K": dequant_q4_k,
    "Q5_K": dequant_q5_k,
    "Q6_K": dequant_q6_k,
    "IQ4_NL": dequant_iq4_nl,
    "IQ4_XS": dequant_iq4_xs,
    "MXFP4": dequant_mxfp4,
}


def check_type(source: str, name: str, qtype: str) -> str:
    if qtype not in DEQUANTIZERS:
        raise ModelLoadError(
            f"{source}: tensor {name} uses quantization {qtype}, which brisk can neither run nor "
            f"dequantize (it reads {', '.join(DEQUANTIZERS)}); re-quantize the model to one of those, "
            "e.g. `llama-quantize model.gguf out.gguf Q4_K_M`")
    return qtype
