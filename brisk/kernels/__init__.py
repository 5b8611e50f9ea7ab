"""brisk's compiled CPU kernels and their PyTorch reference.

`quant_matmul.cpp` (weight-only int4/int8 matmuls), `half_matmul.cpp` (bfloat16/float16 weights,
float32 activations), `paged_attention.cpp` (decode attention
through block tables), `fused_ops.cpp` (a decoder layer's norm, RoPE, SiLU-gate and K/V store,
one call each; Python side in `fused.py`), `decoder.cpp` (a decode step's whole layer stack over
those, driven by `brisk/engine/decode_stack.py`) and `repack.cpp` (a GGUF conversion's byte moves,
`brisk/loading/repack.py`), see their headers, make one plain C library,
`_kernels.so`.
`make` builds it next to this file (`python -m brisk.kernels`), and so does `pip install` of a
checkout (setup.py); an install without either builds it on first use into
`$BRISK_CACHE/kernels/` when a C++ compiler is present. Without
either, `library()` is None and `brisk.models.quant` runs the torch reference instead (a logged
warning says why). The torch reference here is also the oracle the tests hold the kernel to.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import threading
from pathlib import Path

import torch

from brisk import switches
from brisk.kv_dtype import DTYPES, KVDtype
from brisk.kernels import abi, kv_codec
from brisk.kernels.build import SOURCES, build, source_tag

log = logging.getLogger("brisk.kernels")

QK = 32  # weights per quantization block
TILE_ROWS = 8  # weight rows per tile of the tiled int4 and int8 layouts
TILE_BYTES = {2: 64, 3: 96, 4: 128, 5: 160, 6: 192, 8: 256}  # bytes per tile and block of 32 weights
# `bits` of the iq4 layout (GGUF IQ4_NL/IQ4_XS kept as stored, quant_matmul.cpp "iq4"): 4-bit codes in
# int4's tiles, each standing for one of IQ4_VALUES (llama.cpp's kvalues_iq4nl), times a scale
IQ4 = 20
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# `bits` of MXFP4 (GGUF MXFP4, gpt-oss's experts; quant_matmul.cpp "MXFP4"): E2M1 codes in int4's tiles, each
# standing for one of MXFP4_VALUES (the E2M1 values doubled, gguf's kvalues), times 2^(e - 128) for the block's
# E8M0 byte e (`scales` uint8 [N/8, K/32, 8])
MXFP4 = 21
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
CODEBOOKS = {IQ4: IQ4_VALUES, MXFP4: MXFP4_VALUES}
SIGNED_OFFSETS = {3: 4, 6: 32}  # K-quants without mins kept as stored (Q3_K, Q6_K): w = d * sc * (q - offset)
PACKAGE_LIB = Path(__file__).with_name("_kernels.so")

_lib: ctypes.CDLL | None = None
_lib_tried = False


def _fresh(path: Path) -> bool:
    tag = path.parent / (path.name + ".tag")
    return path.is_file() and tag.is_file() and tag.read_text() == source_tag()


def _bind(path: Path) -> ctypes.CDLL:
    return abi.declare(ctypes.CDLL(str(path)))


def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them into the cache if `make` did not; None if impossible."""
    global _lib, _lib_tried
    if _lib_tried:
        return _lib
    _lib_tried = True
    if switches.choice("BRISK_KERNELS") == "torch":
        return None
    candidates = [PACKAGE_LIB]
    try:
        from brisk.cache_dir import cache_dir

        candidates.append(cache_dir() / "kernels" / f"kernels-{source_tag()}.so")
    except Exception:  # an unusable cache dir is reported by the loader; here it only means no fallback build
        pass
    for path in candidates:
        if _fresh(path) or (path != PACKAGE_LIB and path.is_file()):
            _lib = _bind(path)
            return _lib
    try:
        _lib = _bind(build(candidates[-1]))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("brisk's quantized kernels could not be built (%s); quantized layers run the slower "
                    "torch reference. Run `make` in a checkout, or install g++.", detail.strip()[:200])
    return _lib


def isa() -> str:
    lib = library()
    if lib is None:
        return "torch-reference"
    return {3: "avx512vnni", 2: "avx2"}.get(lib.brisk_kernels_isa(), "scalar")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


HALF_KINDS = {torch.bfloat16: 1, torch.float16: 2}  # half_matmul.cpp's kinds (kv_types.h's codes)


HALF_PANEL = 16  # weight rows per panel of the packed 16-bit layout (half_matmul.cpp, "panels")


def pack_half(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] 16-bit weights -> panels [ceil(N/16), K, 16]: each panel's 16 rows side by side for
    every k (rows past N zero), the layout half_matmul.cpp multiplies fastest at every row count."""
    n, k = weight.shape
    panels = -(-n // HALF_PANEL)
    if panels * HALF_PANEL != n:
        weight = torch.cat([weight, weight.new_zeros(panels * HALF_PANEL - n, k)])
    return weight.reshape(panels, HALF_PANEL, k).transpose(1, 2).contiguous()


def unpack_half(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_half`: [N, K]."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


def half_matmul(x: torch.Tensor, weight: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """x [M, K] float32 contiguous CPU -> [M, N] float32 with W bfloat16 or float16 as stored, [N, K]
    or packed in panels (`pack_half`, 3-D; `n` = N), multiplied in float32 (half_matmul.cpp);
    without the kernels, torch in float32."""
    panels = weight.dim() == 3
    n = n if n is not None else weight.shape[0] * (HALF_PANEL if panels else 1)
    lib = library()
    if lib is None:
        return x @ (unpack_half(weight, n) if panels else weight).float().T
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    call = lib.brisk_half_matmul_panels if panels else lib.brisk_half_matmul
    call(x.data_ptr(), weight.data_ptr(), HALF_KINDS[weight.dtype], m, n, k, out.data_ptr())
    return out


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None,
                 bits: int, subscales: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 contiguous CPU -> [M, N] float32 with W given as quantized blocks (row
    layout, or tiled: 3-D tensors, see `tile_int4` / `tile_int8`; with `subscales`, tiled int4 with
    super-block scales, see `tile_superblocks`), or as 16-bit floats (bits 16)."""
    if bits == 16:
        return half_matmul(x, qweight)
    lib = library()
    if lib is None:
        return reference_matmul(x, qweight, scales, mins, bits, subscales=subscales)
    m, k = x.shape
    tiled = qweight.dim() == 3
    n = scales.shape[0] * (TILE_ROWS if tiled else 1)
    xq, xd, xs, xn = _scratch(m, k)
    out = torch.empty(m, n, dtype=torch.float32)
    lib.brisk_quant_matmul(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), _ptr(mins), _ptr(subscales), bits,
                           int(tiled), m, n, k, xq, xd, xs, xn, out.data_ptr())
    return out


def quant_matmul_experts(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                         bits: int, subscales: torch.Tensor | None, experts: list[int], offsets: list[int]) -> torch.Tensor:
    """A mixture of experts' grouped matmul: x [A, K] float32 contiguous, its rows grouped by expert (rows
    offsets[i] .. offsets[i + 1] - 1 go through expert experts[i]) -> [A, N], with the experts' weights stacked
    and tiled ([E, ...] of each array a tiled quant_matmul takes). One compiled call reads each expert's weights
    once for all its rows; every row gets the bits quant_matmul gives it alone."""
    rows, k = x.shape
    n = scales.shape[1] * TILE_ROWS
    lib = library()
    if lib is None:
        return torch.cat([reference_matmul(x[offsets[i]:offsets[i + 1]], qweight[e], scales[e],
                                           None if mins is None else mins[e], bits,
                                           subscales=None if subscales is None else subscales[e])
                          for i, e in enumerate(experts)])
    xq, xd, xs, xn = _scratch(rows, k)
    out = torch.empty(rows, n, dtype=torch.float32)
    ids = torch.tensor(experts, dtype=torch.int64)
    offs = torch.tensor(offsets, dtype=torch.int64)

    def stride(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.stride(0) * t.element_size()

    if lib.brisk_quant_matmul_experts(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), _ptr(mins), _ptr(subscales),
                                      stride(qweight), stride(scales), stride(mins), stride(subscales), ids.data_ptr(),
                                      offs.data_ptr(), len(experts), bits, n, k, xq, xd, xs, xn, out.data_ptr()):
        raise ValueError(f"quant_matmul_experts: a {n}x{k} expert weight is not in whole tiles and blocks")
    return out


def attention_isa() -> str:
    lib = library()
    if lib is None:
        return "torch-reference"
    # avx512fp16: fp8 KV multiplies in float16 there (fp8_in_float16), every other type as on avx512
    return {4: "avx512fp16", 3: "avx512", 2: "avx2"}.get(lib.brisk_paged_attention_isa(), "portable")


def fp8_in_float16(kv_dtype: KVDtype, head_dim: int) -> bool:
    """Whether the paged attention kernel multiplies this KV dtype in float16 here: fp8 (e4m3, e5m2) on
    AVX512-FP16 CPUs at head_dims that are multiples of 32 (paged_attention.cpp: its results differ from
    float32 arithmetic's by float16's rounding, far below fp8's own)."""
    lib = library()
    return lib is not None and lib.brisk_paged_attention_isa() >= 4 and kv_dtype.element_bytes == 1 \
        and not kv_dtype.scaled and head_dim % 32 == 0


PART_TOKENS = 512  # context positions per work item; a row's parts are merged at the end


def kv_code(cache: torch.Tensor, kv_dtype: KVDtype | None) -> int | None:
    """The kernels' code for a cache tensor holding `kv_dtype` (None: a float cache's own dtype),
    or None where the tensor does not hold what the code names."""
    if kv_dtype is None:
        name = kv_codec.float_kv_name(cache.dtype)
        kv_dtype = DTYPES.get(name) if name else None
    if kv_dtype is None or cache.dtype != kv_codec.storage_dtype(kv_dtype):
        return None
    return kv_dtype.code


def scale_pointers(kv_dtype, scales, k_cache: torch.Tensor) -> tuple[int | None, int | None] | None:
    """int8's scale arrays' addresses ([slots, kv_heads] float32 each), (None, None) for other
    dtypes, or None where they are missing or malformed."""
    if kv_dtype is None or not kv_dtype.scaled:
        return None, None
    if scales is None or any(t is None or t.dtype != torch.float32 or not t.is_contiguous()
                             or t.shape != k_cache.shape[:2] for t in scales):
        return None
    return scales[0].data_ptr(), scales[1].data_ptr()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, part_tokens: int = PART_TOKENS, window: int | None = None,
                           softcap: float | None = None, kv_dtype: KVDtype | None = None,
                           scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """One query per row attending to its context through its block table, in place in the cache
    (with `window`: to the row's last `window` positions only; with `softcap`: Gemma 2's capped
    scores, softcap * tanh(score / softcap); with `sinks` [heads]: gpt-oss's logit per head that joins
    the softmax with no value). Consecutive rows that are one sequence's consecutive
    positions (a prompt chunk laid out as decode rows) walk their context together, in tiles; each
    row's result is bit for bit the one it gets alone.

    q [rows, heads, dim]; k_cache/v_cache [slots, kv_heads, dim] (contiguous) holding `kv_dtype`
    (brisk/kv_dtype.py; None: the float dtype the tensors have), with int8's `scales` (k, v)
    [slots, kv_heads] float32; block_tables [rows, max_blocks] int32; context_lens [rows] int32.
    Returns [rows, heads * dim] float32, or None where the kernel does not apply (no library, not
    CPU, another dtype or shape): the caller then runs the torch path."""
    lib = library()
    code = kv_code(k_cache, kv_dtype)
    pointers = scale_pointers(kv_dtype, scales, k_cache)
    if (lib is None or q.device.type != "cpu" or code is None or pointers is None or v_cache.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return None
    rows, heads, dim = q.shape
    qf = q.float().contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    sink = None if sinks is None else sinks.float().contiguous()
    out = torch.empty(rows, heads * dim, dtype=torch.float32)
    code = lib.brisk_paged_decode_attention(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), code,
                                            *pointers, tables.data_ptr(),
                                            tables.shape[1], lens.data_ptr(), rows, heads, k_cache.shape[1],
                                            dim, block_size, scale, part_tokens, window or 0, softcap or 0.0,
                                            None if sink is None else sink.data_ptr(), out.data_ptr())
    return None if code else out


_scratch_local = threading.local()


def _scratch(m: int, k: int) -> tuple[int, int, int, int]:
    """Addresses of this thread's activation buffers for m x k (int8 values; per block a scale, the
    scaled sum, the integer sum and that of its first 16), grown as needed and reused: a decode step
    makes ~100 matmul calls."""
    have = getattr(_scratch_local, "buffers", None)
    if have is None or have[0].numel() < m * k:
        size = max(m * k, 2 * (have[0].numel() if have is not None else 0))
        have = (torch.empty(size, dtype=torch.int8), torch.empty(size // QK, dtype=torch.float32),
                torch.empty(size // QK, dtype=torch.float32), torch.empty(2 * size // QK, dtype=torch.int32))
        _scratch_local.buffers = have
        _scratch_local.addresses = tuple(t.data_ptr() for t in have)
    return _scratch_local.addresses


# ------------------------------------------------------------------ torch reference (the oracle)

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values in [0, 15] -> [N, K/2] uint8: byte j of a block = q[j] | q[j + 16] << 4 (GGUF's order)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // QK, 2, QK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 in GGUF nibble order -> [N, K] values in [0, 15] (uint8)."""
    n, half = qweight.shape
    blocks = qweight.view(n, half // (QK // 2), QK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).view(n, half * 2)


def _words(t: torch.Tensor) -> torch.Tensor:
    """Bytes -> the same memory as int32 words (the last dimension a multiple of 4)."""
    t = t.contiguous()
    return (t if t.storage_offset() % 4 == 0 else t.clone()).view(torch.int32)


def _tile_words(rows: torch.Tensor, nb: int, words: int, compiled: bool) -> torch.Tensor:
    """Rows [N, nb blocks of `words` 4-byte words] -> [N/8, nb, 32 * words]: per tile and block, word v of its 8
    rows side by side, v by v (repack.cpp's `brisk_tile_words` for CPU tensors when the kernels are built and
    `compiled`)."""
    n = rows.shape[0]
    lib = library() if compiled and rows.device.type == "cpu" else None
    if lib is None:
        w = _words(rows).view(n // TILE_ROWS, TILE_ROWS, nb, words)  # [tile, row, block, v]
        return w.permute(0, 2, 3, 1).contiguous().view(rows.dtype).view(n // TILE_ROWS, nb, 32 * words)
    rows = rows.contiguous()
    out = torch.empty(n // TILE_ROWS, nb, 32 * words, dtype=rows.dtype)
    lib.brisk_tile_words(rows.data_ptr(), n, nb, words, out.data_ptr())
    return out


def tile_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, compiled: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int4 blocks in the row layout ([N, K/2], [N, K/32]) -> the tiled layout the kernel reads fastest
    at every row count (quant_matmul.cpp, "int4 in tiles of 8 weight rows"): qweight [N/8, K/32, 128]
    (per tile and block, 4 vectors of 8 rows x 4 bytes: low nibbles weights 4v..4v+3, high nibbles
    4(v+4)..4(v+4)+3), scales and mins [N/8, K/32, 8]. N must be a multiple of 8. Bytes move, values
    do not: `untile_int4` gives back the same tensors.
    A row-layout byte j of a block holds weights j and j + 16 (GGUF's order), just what byte 4v + e of
    a tile's vector v wants (j = 4v + e): tiling is a transpose of 4-byte words, [row, v] -> [v, row]."""
    n, half = qweight.shape
    if n % TILE_ROWS:
        raise ValueError(f"tiling needs a multiple of {TILE_ROWS} rows, got {n}")
    nb = half * 2 // QK
    return _tile_words(qweight, nb, 4, compiled), _tile_side(scales, n, nb), _tile_side(mins, n, nb)


def tile_int8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, compiled: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int8 blocks in the row layout ([N, K], [N, K/32]) -> the tiled int8 layout (quant_matmul.cpp,
    "int8 in tiles of 8 weight rows"): qweight [N/8, K/32, 256] (per tile and block, 8 vectors of 8 rows
    x 4 bytes: weights 4v..4v+3), scales and mins [N/8, K/32, 8]. N must be a multiple of 8. Bytes
    move, values do not: `untile_int8` gives back the same tensors."""
    n, k = qweight.shape
    if n % TILE_ROWS:
        raise ValueError(f"tiling needs a multiple of {TILE_ROWS} rows, got {n}")
    nb = k // QK
    return _tile_words(qweight, nb, 8, compiled), _tile_side(scales, n, nb), _tile_side(mins, n, nb)


def _tile_side(t: torch.Tensor | None, n: int, nb: int) -> torch.Tensor | None:
    """Per-block scales or offsets [N, K/32] -> [N/8, K/32, 8]: a tile's 8 rows side by side."""
    return None if t is None else t.view(n // TILE_ROWS, TILE_ROWS, nb).transpose(1, 2).contiguous()


def untile_side(t: torch.Tensor | None, n: int, nb: int) -> torch.Tensor | None:
    return None if t is None else t.transpose(1, 2).reshape(n, nb)


def untile_int8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The tiled int8 layout -> the row layout (the inverse of `tile_int8`)."""
    tiles, nb, _ = qweight.shape
    n = tiles * TILE_ROWS
    rows = qweight.view(tiles, nb, 8, TILE_ROWS, 4).permute(0, 3, 1, 2, 4).reshape(n, nb * QK)
    return rows.contiguous(), untile_side(scales, n, nb), untile_side(mins, n, nb)


SUPER = 8  # blocks of 32 per super-block of 256 weights (GGUF's K-quants)


def tile_superblocks(supers: torch.Tensor, super_mins: torch.Tensor | None, subscales: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The scales of K-quants kept as stored, row layout -> tiled: `supers`/`super_mins` float16 [N, K/256]
    (d, dmin) -> [N/8, K/256, 8]; `subscales` [N, K/32, 2] -> [N/8, K/32, 16] (the tile's 8 rows' first,
    then their second). GGUF Q4_K and Q5_K (quant_matmul.cpp, `tile_scales`): uint8 6-bit sc and mn per
    block of 32, the weights tiled as `tile_int4`'s / `tile_int5`'s; Q6_K and Q3_K (no mins): int8 sc of
    each block's two 16s, the weights as `tile_int6`'s / `tile_int3`'s; Q2_K: uint8 sc | mn << 4 of each
    block's two 16s, the weights as `tile_int2`'s; IQ4_XS: [N, K/32, 1] int8 -> [N/8, K/32, 8]."""
    n, nb, per = subscales.shape  # per block: 2 (one per 16, or sc and mn), IQ4_XS 1
    sub = subscales.view(n // TILE_ROWS, TILE_ROWS, nb, per).permute(0, 2, 3, 1).reshape(n // TILE_ROWS, nb, per * 8)
    return _tile_side(supers, n, nb // SUPER), _tile_side(super_mins, n, nb // SUPER), sub.contiguous()


def superblock_scales(supers: torch.Tensor, super_mins: torch.Tensor, subscales: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled super-block scales -> each block's float32 scale d * sc and offset -(dmin * mn), [N/8, K/32, 8]
    like a plain tile's (both exact in float32: what gguf's Q4_K dequantizer computes)."""
    tiles, nb, _ = subscales.shape
    sub = subscales.view(tiles, nb, 2, TILE_ROWS).float()
    d = supers.float().repeat_interleave(SUPER, dim=1)
    dmin = super_mins.float().repeat_interleave(SUPER, dim=1)
    return d * sub[:, :, 0], -(dmin * sub[:, :, 1])


def _low_nibble_tiles(q: torch.Tensor) -> torch.Tensor:
    """5/6-bit values [N, K] -> their low 4 bits in int4's tiles [N/8, K/32, 128] (the first 128 bytes of a
    block of the int5/int6 layouts)."""
    if q.shape[0] % TILE_ROWS:
        raise ValueError(f"tiling needs a multiple of {TILE_ROWS} rows, got {q.shape[0]}")
    return tile_int4(pack_int4(q & 0x0F), None, None)[0]


def tile_int5(q: torch.Tensor) -> torch.Tensor:
    """5-bit values [N, K] (uint8 in [0, 31]) -> the tiled int5 layout (quant_matmul.cpp, "int5 and int6 in
    tiles of 8 weight rows"): [N/8, K/32, 160], per tile and block int4's 128 bytes of the low 4 bits, then
    32 bytes of top bits (row j, byte e: bit u = weight 4u + e)."""
    low, (n, k) = _low_nibble_tiles(q), q.shape
    nb = k // QK
    top = (q >> 4).view(n // TILE_ROWS, TILE_ROWS, nb, 8, 4).permute(0, 2, 1, 4, 3)  # [tile, block, row, e, u]
    packed = (top << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # an or: no bits overlap
    return torch.cat([low, packed.reshape(n // TILE_ROWS, nb, 32)], dim=2).contiguous()


def untile_int5(qweight: torch.Tensor) -> torch.Tensor:
    """The tiled int5 layout -> 5-bit values [N, K] (the inverse of `tile_int5`)."""
    tiles, nb, _ = qweight.shape
    n = tiles * TILE_ROWS
    low = unpack_int4(untile_int4(qweight[:, :, :128], None, None)[0])
    top = (qweight[:, :, 128:].reshape(tiles, nb, TILE_ROWS, 4, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return low | (top.permute(0, 2, 1, 4, 3).reshape(n, nb * QK) << 4)  # [row, block, u, e]


def untile_values(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """A tiled weight's values [N, K] (uint8; int8 for bits 8), as the row layout holds them unpacked."""
    if bits == 4:
        return unpack_int4(untile_int4(qweight, None, None)[0])
    if bits == 8:
        return untile_int8(qweight, None, None)[0]
    return {2: untile_int2, 3: untile_int3, 5: untile_int5, 6: untile_int6}[bits](qweight)


def _two_bit_planes(q: torch.Tensor) -> torch.Tensor:
    """Values [N, K] -> their low 2 bits as two 32-byte vectors per tile and block, [N/8, K/32, 64] (vector k,
    row j, byte e: bits 2v..2v+1 = weight 16k + 4v + e): all of an int2 block, the first 64 bytes of int3's."""
    n, k = q.shape
    if n % TILE_ROWS:
        raise ValueError(f"tiling needs a multiple of {TILE_ROWS} rows, got {n}")
    nb = k // QK
    low = (q & 3).view(n // TILE_ROWS, TILE_ROWS, nb, 2, 4, 4).permute(0, 2, 3, 1, 5, 4)  # [tile, block, k, row, e, v]
    low = (low << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # an or: no overlap
    return low.reshape(n // TILE_ROWS, nb, 64)


def _from_two_bit_planes(planes: torch.Tensor) -> torch.Tensor:
    """The inverse of `_two_bit_planes`: [N, K] values in [0, 3]."""
    tiles, nb, _ = planes.shape
    low = planes.reshape(tiles, nb, 2, TILE_ROWS, 4, 1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    return (low & 3).permute(0, 3, 1, 2, 5, 4).reshape(tiles * TILE_ROWS, nb * QK)  # [row, block, k, v, e]


def tile_int2(q: torch.Tensor) -> torch.Tensor:
    """2-bit values [N, K] (uint8 in [0, 3]) -> the tiled int2 layout (quant_matmul.cpp, "int3 and int2 in
    tiles of 8 weight rows"): [N/8, K/32, 64], per tile and block two 32-byte vectors of the 2-bit values."""
    return _two_bit_planes(q).contiguous()


def untile_int2(qweight: torch.Tensor) -> torch.Tensor:
    """The tiled int2 layout -> 2-bit values [N, K] (the inverse of `tile_int2`)."""
    return _from_two_bit_planes(qweight)


def tile_int3(q: torch.Tensor) -> torch.Tensor:
    """3-bit values [N, K] (uint8 in [0, 7]) -> the tiled int3 layout (quant_matmul.cpp, "int3 and int2 in
    tiles of 8 weight rows"): [N/8, K/32, 96], per tile and block two 32-byte vectors of the low 2 bits
    (`_two_bit_planes`), then 32 bytes of top bits as int5's (row j, byte e: bit u = weight 4u + e)."""
    n, k = q.shape
    low, nb = _two_bit_planes(q), k // QK
    top = (q >> 2).view(n // TILE_ROWS, TILE_ROWS, nb, 8, 4).permute(0, 2, 1, 4, 3)  # [tile, block, row, e, u]
    top = (top << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return torch.cat([low, top.reshape(n // TILE_ROWS, nb, 32)], dim=2).contiguous()


def untile_int3(qweight: torch.Tensor) -> torch.Tensor:
    """The tiled int3 layout -> 3-bit values [N, K] (the inverse of `tile_int3`)."""
    tiles, nb, _ = qweight.shape
    n = tiles * TILE_ROWS
    low = _from_two_bit_planes(qweight[:, :, :64])
    top = (qweight[:, :, 64:].reshape(tiles, nb, TILE_ROWS, 4, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return low | (top.permute(0, 2, 1, 4, 3).reshape(n, nb * QK) << 2)  # [row, block, u, e]


def tile_int6(q: torch.Tensor) -> torch.Tensor:
    """6-bit values [N, K] (uint8 in [0, 63]) -> the tiled int6 layout (quant_matmul.cpp, "int5 and int6 in
    tiles of 8 weight rows"): [N/8, K/32, 192], per tile and block int4's 128 bytes of the low 4 bits, then two
    32-byte vectors of the top 2 bits (vector k, row j, byte e: bits 2v..2v+1 = weight 16k + 4v + e)."""
    low, (n, k) = _low_nibble_tiles(q), q.shape
    nb = k // QK
    top = (q >> 4).view(n // TILE_ROWS, TILE_ROWS, nb, 2, 4, 4)  # [tile, row, block, half k, v, e]
    top = top.permute(0, 2, 3, 1, 5, 4)  # [tile, block, k, row, e, v]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    packed = (top << shifts).sum(-1, dtype=torch.uint8)  # bit fields do not overlap: the sum is an or
    return torch.cat([low, packed.reshape(n // TILE_ROWS, nb, 64)], dim=2).contiguous()


def untile_int6(qweight: torch.Tensor) -> torch.Tensor:
    """The tiled int6 layout -> 6-bit values [N, K] (the inverse of `tile_int6`)."""
    tiles, nb, _ = qweight.shape
    n = tiles * TILE_ROWS
    low = unpack_int4(untile_int4(qweight[:, :, :128], None, None)[0]).view(n, nb, 2, 4, 4)
    top = qweight[:, :, 128:].reshape(tiles, nb, 2, TILE_ROWS, 4, 1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    top = (top & 3).permute(0, 3, 1, 2, 5, 4).reshape(n, nb, 2, 4, 4)  # [row, block, k, v, e]
    return (low | (top << 4)).reshape(n, nb * QK)


def tile_values(q: torch.Tensor, bits: int, compiled: bool = True) -> torch.Tensor:
    """Values [N, K] (uint8, one a byte) -> the tiled int2/int3/int5/int6 layout (`tile_int2` .. `tile_int6`):
    repack.cpp's `brisk_tile_values` when the kernels are built (tests/test_repack.py holds it to those
    functions, byte for byte), else they."""
    lib = library() if compiled and q.device.type == "cpu" else None
    if lib is None:
        return {2: tile_int2, 3: tile_int3, 5: tile_int5, 6: tile_int6}[bits](q)
    n, k = q.shape
    if n % TILE_ROWS or k % QK:
        raise ValueError(f"tiling needs a multiple of {TILE_ROWS} rows and {QK} columns, got {n} x {k}")
    q = q.contiguous()
    out = torch.empty(n // TILE_ROWS, k // QK, TILE_BYTES[bits], dtype=torch.uint8)
    if lib.brisk_tile_values(q.data_ptr(), n, k, bits, out.data_ptr()):
        raise ValueError(f"no compiled tiling for {bits}-bit values")
    return out


def signed_rows(qweight: torch.Tensor, supers: torch.Tensor, subscales: torch.Tensor, bits: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled int3/int6 with their scales (GGUF Q3_K/Q6_K kept as stored) -> the row layout: values [N, K]
    (uint8, 0..7 or 0..63), d [N, K/256] float16 and sc [N, K/16] int8."""
    tiles, nb, _ = subscales.shape
    sc = subscales.view(tiles, nb, 2, TILE_ROWS).permute(0, 3, 1, 2).reshape(tiles * TILE_ROWS, nb * 2)
    return untile_values(qweight, bits), untile_side(supers, tiles * TILE_ROWS, nb // SUPER), sc


def dequantize_signed(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, bits: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row-layout 3/6-bit weights -> [N, K]: (d * sc) * (q - offset) in float32, gguf's Q3_K/Q6_K expression
    and order (offset 4 or 32, SIGNED_OFFSETS)."""
    n, k = q.shape
    step = d.float().repeat_interleave(SUPER * 2, dim=1) * sc.float()  # [N, K/16]
    return (step[..., None] * (q.view(n, k // 16, 16).float() - SIGNED_OFFSETS[bits])).view(n, k).to(dtype)


def int2_rows(qweight: torch.Tensor, supers: torch.Tensor, super_mins: torch.Tensor, subscales: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled int2 with its scales (GGUF Q2_K kept as stored) -> the row layout: values [N, K] (uint8, 0..3),
    d and dmin [N, K/256] float16, and [N, K/16] uint8 (sc in the low nibble, mn in the high)."""
    tiles, nb, _ = subscales.shape
    n = tiles * TILE_ROWS
    sub = subscales.view(tiles, nb, 2, TILE_ROWS).permute(0, 3, 1, 2).reshape(n, nb * 2)
    return untile_int2(qweight), untile_side(supers, n, nb // SUPER), untile_side(super_mins, n, nb // SUPER), sub


def dequantize_int2(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sub: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row-layout 2-bit weights -> [N, K]: (d * sc) * q - dmin * mn in float32, gguf's Q2_K expression and order."""
    n, k = q.shape
    step = d.float().repeat_interleave(SUPER * 2, dim=1) * (sub & 0x0F).float()  # [N, K/16]
    shift = dmin.float().repeat_interleave(SUPER * 2, dim=1) * (sub >> 4).float()
    return (step[..., None] * q.view(n, k // 16, 16).float() - shift[..., None]).view(n, k).to(dtype)


def dequantize_iq4(qweight: torch.Tensor, scales: torch.Tensor, subscales: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tiled iq4 layout -> [N, K]: IQ4_VALUES[q] times d per 32 (IQ4_NL: `scales` [N/8, K/32, 8]), or times
    d * sc (IQ4_XS: `scales` [N/8, K/256, 8] float16, `subscales` [N/8, K/32, 8] int8), in float32: gguf's
    expressions and order."""
    tiles, nb, _ = qweight.shape
    n = tiles * TILE_ROWS
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32)[untile_values(qweight, 4).long()]
    if subscales is None:
        step = untile_side(scales, n, nb).float()
    else:
        step = untile_side(scales, n, nb // SUPER).float().repeat_interleave(SUPER, dim=1) * \
            untile_side(subscales, n, nb).float()
    return (step[..., None] * values.reshape(n, nb, QK)).reshape(n, nb * QK).to(dtype)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> 2^(e - 128) float32, bit for bit gguf's e8m0_to_fp32_half (e < 2: the float's subnormals)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tiled MXFP4 layout -> [N, K]: MXFP4_VALUES[q] * 2^(e - 128), in float32: gguf's expression."""
    tiles, nb, _ = qweight.shape
    n = tiles * TILE_ROWS
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)[untile_values(qweight, 4).long()]
    step = e8m0_half(untile_side(scales, n, nb))
    return (step[..., None] * values.reshape(n, nb, QK)).reshape(n, nb * QK).to(dtype)


def untile_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The tiled int4 layout -> the row layout (the inverse of `tile_int4`: the words transposed back)."""
    tiles, nb, _ = qweight.shape
    n = tiles * TILE_ROWS
    words = _words(qweight).view(tiles, nb, 4, TILE_ROWS)  # [tile, block, v, row]
    rows = words.permute(0, 3, 1, 2).contiguous().view(torch.uint8).view(n, nb * QK // 2)
    return rows, untile_side(scales, n, nb), untile_side(mins, n, nb)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None, bits: int,
               dtype: torch.dtype = torch.float32, subscales: torch.Tensor | None = None) -> torch.Tensor:
    """Quantized blocks -> dense [N, K] weights (w = d * q + m; int4 without m: m = -8 d; with
    `subscales`, d and m from the super-block scales, see `superblock_scales`); 16-bit float weights
    (bits 16) are widened (exact)."""
    if bits == 16:
        return (unpack_half(qweight, qweight.shape[0] * HALF_PANEL) if qweight.dim() == 3 else qweight).to(dtype)
    if bits in SIGNED_OFFSETS:  # tiled only, with their scales (GGUF Q3_K, Q6_K)
        return dequantize_signed(*signed_rows(qweight, scales, subscales, bits), bits, dtype)
    if bits == 2:  # tiled only, with its scales (GGUF Q2_K)
        return dequantize_int2(*int2_rows(qweight, scales, mins, subscales), dtype)
    if bits == IQ4:  # tiled only (GGUF IQ4_NL, IQ4_XS)
        return dequantize_iq4(qweight, scales, subscales, dtype)
    if bits == MXFP4:  # tiled only
        return dequantize_mxfp4(qweight, scales, dtype)
    if subscales is not None:
        scales, mins = superblock_scales(scales, mins, subscales)
    if qweight.dim() == 3:
        n, nb = qweight.shape[0] * TILE_ROWS, qweight.shape[1]
        q, scales, mins = untile_values(qweight, bits), untile_side(scales, n, nb), untile_side(mins, n, nb)
    else:
        q = unpack_int4(qweight) if bits == 4 else qweight
    return dequantize_values(q, scales, mins, bits, dtype)


def dequantize_values(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row-layout values [N, K] (unpacked) with per-block scales (and offsets) [N, K/32] -> [N, K]."""
    n, k = q.shape
    d = scales.float().view(n, k // QK, 1)
    q = q.view(n, k // QK, QK).float()
    if mins is None and bits == 4:
        values = (q - 8) * d  # GGUF Q4_0's own expression, so repacked Q4_0 dequantizes bit for bit
    else:
        values = q * d
    if mins is not None:
        values += mins.float().view(n, k // QK, 1)
    return values.view(n, k).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization, in torch: x [M, K] -> (q [M, K] int8, d [M, K/32])."""
    m, k = x.shape
    blocks = x.float().view(m, k // QK, QK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.view(m, k), d


def reference_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     bits: int, subscales: torch.Tensor | None = None, quantized_activations: bool = True
                     ) -> torch.Tensor:
    """What the kernel computes, in float64: with `quantized_activations` the same int8 activation
    blocks (so kernel and reference differ only by float summation order), else plain x."""
    w = dequantize(qweight, scales, mins, bits, torch.float64, subscales)
    if not quantized_activations or bits == 16:  # 16-bit float weights take float32 activations as they are
        return (x.double() @ w.T).float()
    q, d = quantize_activations(x)
    m, k = x.shape
    xr = (q.view(m, k // QK, QK).double() * d.double()[..., None]).view(m, k)
    return (xr @ w.T).float()


def main() -> int:
    """`python -m brisk.kernels`: build the kernels next to the package (what `make` runs)."""
    try:
        build(PACKAGE_LIB)
    except subprocess.CalledProcessError as e:
        print(f"brisk: building the C++ kernels failed:\n{e.stderr}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"brisk: cannot build the C++ kernels ({', '.join(s.name for s in SOURCES)}): {e}; "
              "install g++ (apt-get install g++)", file=sys.stderr)
        return 1
    print(f"built {PACKAGE_LIB}")
    return 0
