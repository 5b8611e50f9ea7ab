"""Quantized weights: the compiled int4/int8 kernel, GGUF repacking, quantize-at-load, and the
loaded model, each against references nobody here wrote (`gguf`'s dequantizer, HF transformers)
or against float64 arithmetic.

Tolerances, and why:
- kernel vs the same math in float64 (same int8 activation blocks): every block's dot product
  is an exact integer in both, so they differ only by float32 rounding in the sum over
  blocks: rtol 1e-5.
- kernel vs float activations: the kernel rounds each activation to its block's int8 grid, an
  error of at most half a step (d_x / 2) per element, so |y - y_float| <= sum_j |w_j| d_x(j) / 2,
  checked per output element (plus 1e-5 for float rounding).
- repacked GGUF weights vs `gguf.quants.dequantize`: bit for bit for Q4_0/Q4_1/Q8_0 (bytes are
  sliced, not recomputed); Q2_K, Q3_K, Q4_K, Q5_K and Q6_K kept as stored bit for bit too (and Q4_K, where its rows
  do not fill tiles, within the float16 rounding of each block's scale and offset); Q5 types (and
  Q2_K/Q3_K/Q5_K/Q6_K that cannot be tiled) requantized to int8 within half an int8 step of the block.
"""

import functools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from isa_paths import force_matmul
from test_dequant import _random_blocks

from brisk import kernels
from brisk.errors import BriskError
from brisk.loading import gguf_convert
from brisk.loading.gguf_random import Shape, write_random_gguf
from brisk.loading.loader import load
from brisk.models.quant import QuantFormat, QuantLinear, StackedQuantLinear, quantize_int4, quantize_int8, tile
from brisk.models.simple_cache import SingleSequenceCache


def random_blocks(bits, has_mins, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    else:
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02).half()
    mins = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.2).half() if has_mins else None
    return qweight, scales, mins


ISA_LEVELS = {"avx512vnni": 3, "avx2": 2, "scalar": 0}


def matmul_paths_here() -> list[int]:
    """Every matmul path this CPU runs, best first (at least avx2 and the portable loop)."""
    return [level for level in (3, 2, 0) if level <= ISA_LEVELS[kernels.isa()]]


@pytest.fixture(params=list(ISA_LEVELS))
def isa(request):
    lib = kernels.library()
    assert lib is not None, "the compiled kernels are missing: `make` builds them"
    force_matmul(lib, ISA_LEVELS[request.param])
    yield request.param
    lib.brisk_kernels_force_isa(-1)


FORMATS = [(4, False), (4, True), (8, False), (8, True)]


@pytest.mark.parametrize("bits,has_mins", FORMATS)
@pytest.mark.parametrize("k", [96, 512])  # 3 blocks (scalar tail of the offset sum), 16 blocks
def test_kernel_matches_float64_with_the_same_activation_blocks(isa, bits, has_mins, k):
    qweight, scales, mins = random_blocks(bits, has_mins, 37, k)
    for rows in (1, 2, 3, 4, 5, 8, 17, 64):
        x = torch.randn(rows, k) * 3
        out = kernels.quant_matmul(x, qweight, scales, mins, bits)
        ref = kernels.reference_matmul(x, qweight, scales, mins, bits)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("bits,has_mins", FORMATS)
def test_kernel_error_against_float_activations_is_within_half_an_int8_step(isa, bits, has_mins):
    k = 256
    qweight, scales, mins = random_blocks(bits, has_mins, 29, k, seed=1)
    x = torch.randn(9, k)
    x[:, 5] = 40.0  # an outlier: only its own block gets a coarse grid
    out = kernels.quant_matmul(x, qweight, scales, mins, bits)
    exact = kernels.reference_matmul(x, qweight, scales, mins, bits, quantized_activations=False)
    w = kernels.dequantize(qweight, scales, mins, bits, torch.float64)
    step = x.view(9, k // 32, 32).abs().amax(-1) / 127  # [rows, blocks]
    half_step = step.repeat_interleave(32, dim=1).double() / 2  # [rows, k]
    bound = half_step @ w.abs().T + 1e-5
    assert bool(((out.double() - exact.double()).abs() <= bound).all())
    assert float((out - exact).abs().max()) > 0  # the activations really are quantized


@pytest.mark.parametrize("bits,has_mins", FORMATS)
@pytest.mark.parametrize("n,k", [(40, 576), (37, 96)])  # 18 blocks: groups of 8 and a tail; 3 (odd), 37 rows
def test_rows_do_not_depend_on_the_batch(isa, bits, has_mins, n, k):
    """Greedy batch invariance needs this: a row's output is the same alone or among others. (The
    AVX2 int4 kernel takes one path below 4 rows and another from 4 on: they must agree bit for bit.)"""
    qweight, scales, mins = random_blocks(bits, has_mins, n, k)
    x = torch.randn(19, k)
    together = kernels.quant_matmul(x, qweight, scales, mins, bits)
    for r in (0, 3, 4, 17, 18):
        for start in (r, max(0, r - 1)):  # alone, and in a tile of two
            part = kernels.quant_matmul(x[start:r + 1].contiguous(), qweight, scales, mins, bits)
            assert torch.equal(part[-1], together[r])


TILERS = {4: kernels.tile_int4, 8: kernels.tile_int8}


@pytest.mark.parametrize("has_mins", [False, True])
def test_tiling_moves_bytes_not_values(has_mins):
    qweight, scales, mins = random_blocks(4, has_mins, 48, 96)
    tiled = kernels.tile_int4(qweight, scales, mins)
    assert tiled[0].shape == (6, 3, 128) and tiled[1].shape == (6, 3, 8)
    back = kernels.untile_int4(*tiled)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)
    assert (back[2] is None) if mins is None else torch.equal(back[2], mins)
    assert torch.equal(kernels.dequantize(*tiled, 4), kernels.dequantize(qweight, scales, mins, 4))
    # the layout itself, spelled out for one weight: row 8t+j, weight 32b + 4(v+4) + e is the high
    # nibble of byte v*32 + 4j + e of tile t's block b
    values = kernels.unpack_int4(qweight)  # [48, 96]
    t, j, b, v, e = 3, 5, 2, 1, 2
    assert int(tiled[0][t, b, v * 32 + 4 * j + e]) >> 4 == int(values[8 * t + j, 32 * b + 4 * (v + 4) + e])
    assert int(tiled[0][t, b, v * 32 + 4 * j + e]) & 15 == int(values[8 * t + j, 32 * b + 4 * v + e])
    assert float(tiled[1][t, b, j]) == float(scales[8 * t + j, b])


@pytest.mark.parametrize("has_mins", [False, True])
def test_int8_tiling_moves_bytes_not_values(has_mins):
    qweight, scales, mins = random_blocks(8, has_mins, 48, 96)
    tiled = kernels.tile_int8(qweight, scales, mins)
    assert tiled[0].shape == (6, 3, 256) and tiled[0].dtype == torch.int8 and tiled[1].shape == (6, 3, 8)
    back = kernels.untile_int8(*tiled)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)
    assert (back[2] is None) if mins is None else torch.equal(back[2], mins)
    assert torch.equal(kernels.dequantize(*tiled, 8), kernels.dequantize(qweight, scales, mins, 8))
    # row 8t+j, weight 32b + 4v + e is byte v*32 + 4j + e of tile t's block b
    for t, j, b, v, e in ((3, 5, 2, 1, 2), (0, 7, 0, 7, 3), (5, 0, 1, 4, 0)):
        assert int(tiled[0][t, b, v * 32 + 4 * j + e]) == int(qweight[8 * t + j, 32 * b + 4 * v + e])
        assert float(tiled[1][t, b, j]) == float(scales[8 * t + j, b])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("has_mins", [False, True])
@pytest.mark.parametrize("k", [96, 512])
def test_tiled_kernel_computes_the_row_layouts_weights(isa, bits, has_mins, k):
    """The tiled kernel against float64 math on the untiled weights (so tiling and kernel agree on
    what each byte means), at every row count the engine batches; 40 rows = 5 tiles (int8's VNNI
    loop: two pairs and a tile alone)."""
    qweight, scales, mins = random_blocks(bits, has_mins, 40, k, seed=3)
    if bits == 8:
        qweight[0, :32] = -128  # the byte's extremes: -128 (not written by Q8_0, but valid) and 127
        qweight[1, :32] = 127
    tiled = TILERS[bits](qweight, scales, mins)
    for rows in (1, 2, 3, 4, 5, 8, 17, 64):
        x = torch.randn(rows, k) * 3
        x[0, :32] = torch.where(torch.arange(32) % 2 == 0, 50.0, -50.0)  # activation bytes of +-127
        out = kernels.quant_matmul(x, *tiled, bits)
        ref = kernels.reference_matmul(x, qweight, scales, mins, bits)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("has_mins", [False, True])
def test_tiled_rows_do_not_depend_on_the_batch(isa, bits, has_mins):
    qweight, scales, mins = random_blocks(bits, has_mins, 40, 576)
    tiled = TILERS[bits](qweight, scales, mins)
    x = torch.randn(19, 576)
    together = kernels.quant_matmul(x, *tiled, bits)
    for r in (0, 3, 4, 17, 18):
        for start in (r, max(0, r - 1), max(0, r - 5)):  # alone, in a pair, in a tile of 4 and a tail
            part = kernels.quant_matmul(x[start:r + 1].contiguous(), *tiled, bits)
            assert torch.equal(part[-1], together[r])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("has_mins", [False, True])
def test_tiled_vnni_kernel_is_the_avx2_kernel_bit_for_bit(bits, has_mins):
    """The AVX-512 VNNI tile loops (one tile, and two tiles at once) sum each block's products
    exactly in int32 (as AVX2's int16/int32 partial sums do) and then take the same float steps: they
    must agree with AVX2 bit for bit, so a model's outputs do not depend on which of these CPUs
    serves it, nor on which loop a row count picks. The portable loops take the same steps too."""
    lib = kernels.library()
    qweight, scales, mins = random_blocks(bits, has_mins, 72, 2048, seed=5)  # 9 tiles: 4 pairs and one alone
    tiled = TILERS[bits](qweight, scales, mins)
    paths = matmul_paths_here()  # avx2 and portable on every CPU, avx512vnni where it exists
    try:
        for rows in (1, 3, 4, 7, 8, 9, 17, 64):  # the one-tile loop below 8 rows, tile pairs from 8
            x = torch.randn(rows, 2048) * 2
            x[0, 7] = 90.0  # a coarse block: activation bytes of both signs at full range
            results = []
            for path in paths:
                lib.brisk_kernels_force_isa(path)
                results.append(kernels.quant_matmul(x, *tiled, bits))
            for other in results[1:]:
                assert torch.equal(results[0], other), (rows, float((results[0] - other).abs().max()))
    finally:
        lib.brisk_kernels_force_isa(-1)


def test_quant_linear_adds_bias_and_keeps_input_shape():
    w = torch.randn(10, 64) * 0.1
    packed = quantize_int8(w)
    layer = QuantLinear(64, 10, True, QuantFormat(8, False))
    layer.qweight, layer.scales = packed["qweight"], packed["scales"]
    layer.bias = torch.nn.Parameter(torch.randn(10))
    x = torch.randn(2, 3, 64)
    out = layer(x)
    assert out.shape == (2, 3, 10) and out.dtype == torch.float32
    ref = kernels.reference_matmul(x.view(6, 64), packed["qweight"], packed["scales"], None, 8) + layer.bias
    torch.testing.assert_close(out.view(6, 10), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ quantizers

@pytest.mark.parametrize("quantize,levels", [(quantize_int4, 15), (quantize_int8, 254)])
def test_quantizers_round_to_the_nearest_level(quantize, levels):
    w = torch.randn(16, 128)
    packed = quantize(w)
    bits = 4 if quantize is quantize_int4 else 8
    back = kernels.dequantize(packed["qweight"], packed["scales"], packed.get("mins"), bits)
    blocks = w.view(16, 4, 32)
    step = (blocks.amax(-1) - blocks.amin(-1)) / 15 if bits == 4 else blocks.abs().amax(-1) / 127
    err = (back - w).view(16, 4, 32).abs().amax(-1)
    assert bool((err <= step * 0.5 * 1.01 + 1e-6).all())  # 1%: the scale is stored as float16


# ------------------------------------------------------------------ GGUF repacking vs gguf's dequantizer

def _demo_weights(demo_gguf_path, name="blk.0.attn_q.weight"):
    tensor = next(t for t in _reader(demo_gguf_path).tensors if t.name == name)
    return gguf_dequantize(tensor.data, tensor.tensor_type)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_legacy_types_repack_bit_for_bit(qtype, demo_gguf_path):
    weights = _demo_weights(demo_gguf_path)  # real values, [576, 576]
    raw = gguf_quantize(weights, QT[qtype])
    arrays = gguf_convert._repack_legacy(raw, *weights.shape, qtype)
    fmt = gguf_convert.NATIVE_FORMATS[qtype]
    ours = kernels.dequantize(torch.from_numpy(arrays["qweight"]), torch.from_numpy(arrays["scales"]),
                              torch.from_numpy(arrays["mins"]) if "mins" in arrays else None, fmt.bits)
    np.testing.assert_array_equal(ours.numpy(), gguf_dequantize(raw, QT[qtype]))


# type kept as stored -> (bits, bits a weight)
K_QUANTS = {"Q2_K": (2, 2.625), "Q3_K": (3, 3.5625), "Q4_K": (4, 4.625), "Q5_K": (5, 5.625), "Q6_K": (6, 6.5625)}


def _k_super(qtype, rows, cols, seed):
    """Random GGUF K-quant weights [rows, cols], and brisk's tiled arrays of them (kept as stored):
    (raw blocks, (qweight, scales, mins or None), subscales)."""
    raw = _random_blocks(qtype, rows * cols // 256, np.random.default_rng(seed)).reshape(rows, -1)
    repack = gguf_convert._SUPER_REPACKS[qtype]
    tiled = tile({k: torch.from_numpy(v) for k, v in repack(raw, rows, cols).items()}, K_QUANTS[qtype][0])
    return raw, (tiled["qweight"], tiled["scales"], tiled.get("mins")), tiled["subscales"]


@pytest.mark.parametrize("qtype", list(K_QUANTS))
def test_k_quants_kept_as_stored_repack_bit_for_bit(qtype):
    rows, cols = 16, 768  # 2 tiles, 3 super-blocks
    bits, bits_per_weight = K_QUANTS[qtype]
    raw, (qweight, supers, super_mins), sub = _k_super(qtype, rows, cols, seed=7)
    assert qweight.shape == (2, 24, kernels.TILE_BYTES[bits]) and supers.shape == (2, 3, 8) and sub.shape == (2, 24, 16)
    ours = kernels.dequantize(qweight, supers, super_mins, bits, subscales=sub).numpy()
    np.testing.assert_array_equal(ours, gguf_dequantize(raw, QT[qtype]).reshape(rows, cols))
    stored = [t for t in (qweight, supers, super_mins, sub) if t is not None]
    bytes_per_weight = sum(t.numel() * t.element_size() for t in stored) / (rows * cols)
    fmt = QuantFormat(bits, super_mins is not None, True, superblocks=True)
    assert bytes_per_weight * 8 == fmt.bits_per_weight == bits_per_weight
    assert QuantFormat.of({"w.qweight": qweight, "w.scales": supers, "w.subscales": sub,
                           **({"w.mins": super_mins} if super_mins is not None else {})}, "w") == fmt
    # against the file's own bytes per weight: Q6_K's 210 and Q2_K's 84 per 256 exactly; Q3_K's 110, Q4_K's 144
    # and Q5_K's 176 per 256 plus their 6-bit sc (and mn) widened to bytes
    file_bits = gguf.GGML_QUANT_SIZES[QT[qtype]][1] * 8 / 256
    assert file_bits == bits_per_weight - (0 if qtype in ("Q6_K", "Q2_K") else 0.125)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_k_quant_value_tiling_moves_bytes_not_values(bits):
    q = torch.randint(0, 2 ** bits, (24, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    tiled = {2: kernels.tile_int2, 3: kernels.tile_int3, 5: kernels.tile_int5, 6: kernels.tile_int6}[bits](q)
    assert tiled.shape == (3, 3, kernels.TILE_BYTES[bits])
    assert torch.equal(kernels.untile_values(tiled, bits), q)


@pytest.mark.parametrize("qtype", list(K_QUANTS))
@pytest.mark.parametrize("k", [256, 1024])
def test_k_quant_kernel_computes_gguf_weights_on_every_path(isa, qtype, k):
    """The kernel on K-quants kept as stored, against float64 math on gguf's own dequantization, at every
    row count; 40 rows = 5 tiles (VNNI: two pairs and a tile alone)."""
    raw, tiled, sub = _k_super(qtype, 40, k, seed=11)
    w = torch.from_numpy(gguf_dequantize(raw, QT[qtype]).reshape(40, k)).double()
    for rows in (1, 3, 4, 8, 9, 17):
        x = torch.randn(rows, k) * 3
        out = kernels.quant_matmul(x, *tiled, K_QUANTS[qtype][0], subscales=sub)
        q, d = kernels.quantize_activations(x)
        ref = ((q.view(rows, k // 32, 32).double() * d.double()[..., None]).view(rows, k) @ w.T).float()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


# codebook types kept as stored -> bits a weight (the files': 4.5, 4.25, 4.25). MXFP4: gpt-oss's experts
IQ4_TYPES = {"IQ4_NL": 4.5, "IQ4_XS": 4.3125, "MXFP4": 4.25}
CODEBOOK_BITS = {"IQ4_NL": kernels.IQ4, "IQ4_XS": kernels.IQ4, "MXFP4": kernels.MXFP4}


def _iq4(qtype, rows, cols, seed, every_exponent=False):
    """Random GGUF IQ4 (or MXFP4) weights [rows, cols] and brisk's tiled arrays of them: (raw, (qweight, scales,
    None), subscales or None, the stored codebook). MXFP4's random scale bytes span all 256 exponents."""
    raw = _random_blocks(qtype, rows * cols // gguf.GGML_QUANT_SIZES[QT[qtype]][0],
                         np.random.default_rng(seed)).reshape(rows, -1)
    if qtype == "MXFP4" and not every_exponent:  # exponents that keep a row's sums finite in float32
        raw.reshape(-1, 17)[:, 0] = np.random.default_rng(seed).integers(100, 140, raw.size // 17, dtype=np.uint8)
    elif qtype == "MXFP4":  # the float's subnormal scales (e < 2), the first normal one and the largest
        raw.reshape(-1, 17)[:4, 0] = [0, 1, 2, 255]
    arrays = {k: torch.from_numpy(v) for k, v in gguf_convert._SUPER_REPACKS[qtype](raw, rows, cols).items()}
    table = kernels.MXFP4_VALUES if qtype == "MXFP4" else kernels.IQ4_VALUES
    tiled = tile({**arrays, "codebook": torch.tensor(table, dtype=torch.int8)})
    return raw, (tiled["qweight"], tiled["scales"], None), tiled.get("subscales"), tiled["codebook"]


@pytest.mark.parametrize("qtype", list(IQ4_TYPES))
def test_iq4_kept_as_stored_repacks_bit_for_bit(qtype):
    rows, cols = 16, 768  # 2 tiles, 3 super-blocks
    raw, (qweight, scales, _), sub, codebook = _iq4(qtype, rows, cols, seed=7, every_exponent=True)
    if qtype == "MXFP4":
        assert {0, 1, 2, 255} <= set(raw.reshape(-1, 17)[:, 0].tolist())  # subnormal scales and the largest
    assert qweight.shape == (2, 24, 128)
    assert scales.shape == ((2, 3, 8) if qtype == "IQ4_XS" else (2, 24, 8))
    assert (sub is None) == (qtype != "IQ4_XS") and (sub is None or sub.shape == (2, 24, 8))
    ours = kernels.dequantize(qweight, scales, None, CODEBOOK_BITS[qtype], subscales=sub).numpy()
    np.testing.assert_array_equal(ours, gguf_dequantize(raw, QT[qtype]).reshape(rows, cols))
    fmt = QuantFormat.of({"w.qweight": qweight, "w.scales": scales, "w.codebook": codebook,
                          **({"w.subscales": sub} if sub is not None else {})}, "w")
    assert fmt == QuantFormat(4, False, True, superblocks=sub is not None, codebook=True, e8m0=qtype == "MXFP4")
    assert fmt.kernel_bits == CODEBOOK_BITS[qtype]
    assert fmt.name == {"IQ4_NL": "iq4", "IQ4_XS": "iq4/k", "MXFP4": "mxfp4"}[qtype]
    stored = [t for t in (qweight, scales, sub) if t is not None]
    assert sum(t.numel() * t.element_size() for t in stored) * 8 / (rows * cols) == fmt.bits_per_weight == IQ4_TYPES[qtype]
    # the file's own bits a weight: IQ4_NL's exactly; IQ4_XS's 6-bit scales widened to bytes
    assert gguf.GGML_QUANT_SIZES[QT[qtype]][1] * 8 / gguf.GGML_QUANT_SIZES[QT[qtype]][0] == \
        IQ4_TYPES[qtype] - (0.0625 if qtype == "IQ4_XS" else 0)
    with pytest.raises(BriskError, match="IQ4 or MXFP4 table"):  # a table the kernels do not know is refused
        QuantFormat.of({"w.qweight": qweight, "w.scales": scales, "w.codebook": codebook.flip(0)}, "w")


@pytest.mark.parametrize("qtype", list(IQ4_TYPES))
@pytest.mark.parametrize("k", [256, 1024])
def test_iq4_kernel_computes_gguf_weights_on_every_path(isa, qtype, k):
    raw, tiled, sub, _ = _iq4(qtype, 40, k, seed=11)
    w = torch.from_numpy(gguf_dequantize(raw, QT[qtype]).reshape(40, k)).double()
    for rows in (1, 3, 4, 8, 9, 17):
        x = torch.randn(rows, k) * 3
        out = kernels.quant_matmul(x, *tiled, CODEBOOK_BITS[qtype], subscales=sub)
        q, d = kernels.quantize_activations(x)
        ref = ((q.view(rows, k // 32, 32).double() * d.double()[..., None]).view(rows, k) @ w.T).float()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("qtype", list(K_QUANTS) + list(IQ4_TYPES))
def test_k_quant_paths_agree_bit_for_bit_alone_or_batched(qtype):
    lib = kernels.library()
    if qtype in IQ4_TYPES:
        bits, (_, tiled, sub, _) = CODEBOOK_BITS[qtype], _iq4(qtype, 72, 1024, seed=5)
    else:
        bits, (_, tiled, sub) = K_QUANTS[qtype][0], _k_super(qtype, 72, 1024, seed=5)
    x = torch.randn(19, 1024) * 2
    x[3] = 127.0  # every activation at the int8 extreme (the int6 zero point's largest correction)
    try:
        results = []
        for path in matmul_paths_here():
            lib.brisk_kernels_force_isa(path)
            together = kernels.quant_matmul(x, *tiled, bits, subscales=sub)
            for r in (0, 3, 4, 18):
                assert torch.equal(kernels.quant_matmul(x[r:r + 1].contiguous(), *tiled, bits, subscales=sub)[0],
                                   together[r])
            results.append(together)
        assert all(torch.equal(results[0], other) for other in results[1:])
    finally:
        lib.brisk_kernels_force_isa(-1)


def test_q4_k_maps_onto_int4_blocks_within_float16_scale_rounding():
    """Where a Q4_K weight cannot be tiled (rows not a multiple of 8), it becomes plain int4 blocks."""
    rng = np.random.default_rng(7)
    rows, cols = 8, 512
    raw = _random_blocks("Q4_K", rows * cols // 256, rng).reshape(rows, -1)
    arrays = gguf_convert._repack_q4_k(raw, rows, cols)
    ours = kernels.dequantize(torch.from_numpy(arrays["qweight"]), torch.from_numpy(arrays["scales"]),
                              torch.from_numpy(arrays["mins"]), 4).numpy()
    expected = gguf_dequantize(raw, QT.Q4_K).reshape(rows, cols)
    # each block's scale and offset were rounded to float16: relative error <= 2^-11 of each
    scale = np.abs(arrays["scales"].astype(np.float32)).repeat(32, axis=1)
    offset = np.abs(arrays["mins"].astype(np.float32)).repeat(32, axis=1)
    assert np.all(np.abs(ours - expected) <= (15 * scale + offset) * 2.0 ** -11 * 1.01 + 1e-6)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K"])  # K-quants: where their rows do not fill tiles
def test_five_and_six_bit_types_become_int8_within_half_a_step(qtype):
    rng = np.random.default_rng(3)
    rows, cols = 4, 256
    raw = _random_blocks(qtype, rows * cols // gguf.GGML_QUANT_SIZES[QT[qtype]][0], rng).reshape(rows, -1)
    expected = gguf_dequantize(raw, QT[qtype]).reshape(rows, cols)
    packed = quantize_int8(torch.from_numpy(np.ascontiguousarray(expected)))
    ours = kernels.dequantize(packed["qweight"], packed["scales"], None, 8).numpy()
    half_step = np.abs(expected).reshape(rows, -1, 32).max(-1).repeat(32, axis=1) / 127 / 2
    assert np.all(np.abs(ours - expected) <= half_step * 1.01 + 1e-6)


# ------------------------------------------------------------------ whole models

SMALL = Shape(hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, context=128)


# K-quants' super-blocks need rows of whole 256s (same heads, so the Q/K permutation is SMALL's)
SMALL_K = Shape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, context=128)


# Q4_K_M / Q5_K_M: Q4_K / Q5_K with Q6_K attn_v, ffn_down and output; Q3_K_M: Q3_K with Q4_K attn_v,
# attn_output and ffn_down, Q6_K output; Q2_K_mix: Q2_K with Q3_K attn_v and ffn_down, Q6_K output
# (gguf_random.MIXES): q/k and v in different types
@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K_mix",
                                        "IQ4_NL", "IQ4_XS"])
def random_gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / f"small-{request.param}.gguf"
    shape = SMALL_K if request.param.startswith((*K_QUANTS, *IQ4_TYPES)) else SMALL
    return write_random_gguf(path, shape, request.param, None, tied_embeddings=request.param in ("Q8_0", "Q4_K"))


@functools.lru_cache(maxsize=2)
def _reader(path):
    return gguf.GGUFReader(str(path))  # the demo's is slow to open (49k-entry tokenizer arrays): once


def _gguf_float(path, name):
    t = next(t for t in _reader(path).tensors if t.name == name)
    return torch.from_numpy(gguf_dequantize(t.data, t.tensor_type).copy())


def _logits(loaded, ids):
    cache = SingleSequenceCache(loaded.config, len(ids), torch.float32, "cpu")
    cache.begin(len(ids))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache))


def test_converted_gguf_keeps_every_weight_exactly(random_gguf, brisk_cache):
    """Every quantized matrix of the served model equals gguf's dequantization of the file
    (fused, and with llama.cpp's Q/K row permutation undone)."""
    loaded = load(str(random_gguf))
    layer = loaded.model.model.layers[1]
    qkv = layer.self_attn.qkv_proj
    q, k, v = (_gguf_float(random_gguf, f"blk.1.attn_{p}.weight") for p in "qkv")
    q = torch.from_numpy(gguf_convert._unpermute(q.numpy(), SMALL.heads))
    k = torch.from_numpy(gguf_convert._unpermute(k.numpy(), SMALL.kv_heads))
    assert torch.equal(qkv.dequantized(), torch.cat([q, k, v]))
    types = {t.name: t.tensor_type for t in _reader(random_gguf).tensors}
    if types["blk.1.attn_v.weight"] != types["blk.1.attn_q.weight"]:  # stored apart, each part in its own type
        assert isinstance(qkv, StackedQuantLinear) and [p.out_features for p in qkv.parts] == [len(q) + len(k), len(v)]
        parts = qkv.parts
    else:
        assert isinstance(qkv, QuantLinear)
        parts = [qkv]
    for part, name in zip(parts, ("attn_q", "attn_v")):
        # linears and the embedding (a tied head multiplies by it) are stored tiled, the kernel's fast layout
        assert part.fmt.tiled and part.qweight.dim() == 3
        kind = types[f"blk.1.{name}.weight"].name
        assert part.fmt.superblocks == (kind in K_QUANTS or kind == "IQ4_XS")  # K-quants kept as stored
        assert part.fmt.codebook == (kind in IQ4_TYPES)
        assert part.fmt.bits == {QT.Q2_K: 2, QT.Q3_K: 3, QT.Q5_K: 5, QT.Q6_K: 6, QT.Q8_0: 8}.get(types[f"blk.1.{name}.weight"], 4)
    assert loaded.model.model.embed_tokens.fmt.tiled and loaded.model.lm_head.fmt.tiled
    assert torch.equal(layer.mlp.down_proj.dequantized(), _gguf_float(random_gguf, "blk.1.ffn_down.weight"))
    head_name = "token_embd.weight" if loaded.config.tie_word_embeddings else "output.weight"
    assert torch.equal(loaded.model.lm_head.dequantized(), _gguf_float(random_gguf, head_name))
    ids = torch.tensor([[3, 17, 99], [8, 8, 127]])  # rows of several tiles, twice the same, the last
    assert torch.equal(loaded.model.model.embed_tokens(ids), _gguf_float(random_gguf, "token_embd.weight")[ids])


def test_dequantized_for_other_devices_keeps_every_weight(random_gguf, brisk_cache):
    """Off the CPU the quantized kernels do not run: every weight becomes float (a stacked projection's
    parts one weight again), equal to the served model's."""
    from brisk.loading import safetensors_io
    from brisk.loading.loader import _dequantize_all

    loaded = load(str(random_gguf))
    shards, _, _ = safetensors_io.load_checkpoint(loaded.model_dir)
    tensors = {n: t for shard in shards for n, t in shard.items()}
    _dequantize_all(tensors)
    assert not any(n.rpartition(".")[2] in ("qweight", "scales", "mins", "subscales") or ".parts." in n for n in tensors)
    assert torch.equal(tensors["model.layers.1.self_attn.qkv_proj.weight"],
                       loaded.model.model.layers[1].self_attn.qkv_proj.dequantized())


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_k_quant_tables_that_do_not_fill_tiles_become_int8(qtype, tmp_path, brisk_cache):
    """A 132-token vocabulary (not a multiple of 8 rows): the K-quant embedding and LM head cannot be tiled,
    so the conversion stores them int8, within half an int8 step of gguf's values; the layers keep their type."""
    path = write_random_gguf(tmp_path / f"v132-{qtype}.gguf", SMALL_K, qtype, None, small_vocab=132)
    loaded = load(str(path))
    bits = {"Q2_K": 2, "Q3_K": 3, "Q5_K": 5, "Q6_K": 6, "IQ4_NL": kernels.IQ4, "IQ4_XS": kernels.IQ4}[qtype]
    assert loaded.model.model.layers[0].self_attn.qkv_proj.fmt.kernel_bits == bits
    for module, name in ((loaded.model.lm_head, "output.weight"), (loaded.model.model.embed_tokens, "token_embd.weight")):
        assert module.fmt.bits == 8 and not module.fmt.superblocks and not module.fmt.codebook
        expected = _gguf_float(path, name).numpy()
        ours = module.dequantized().numpy()
        half_step = np.abs(expected).reshape(132, -1, 32).max(-1).repeat(32, axis=1) / 127 / 2
        assert np.all(np.abs(ours - expected) <= half_step * 1.01 + 1e-6)


def test_quantized_model_equals_the_float_model_up_to_activation_rounding(random_gguf, brisk_cache, monkeypatch):
    """With the kernel's int8 activation blocks swapped for float activations, the quantized
    model computes the float32 model's logits; with them, the top token rarely changes."""
    ids = list(range(5, 45))  # within the 128-token vocabulary
    float_model = load(str(random_gguf), quantization="none")
    assert not float_model.report.weight_formats
    quantized = load(str(random_gguf))
    reference = _logits(float_model, ids)
    served = _logits(quantized, ids)
    with monkeypatch.context() as m:
        m.setattr(kernels, "quant_matmul",
                  lambda *a: kernels.reference_matmul(*a, quantized_activations=False))
        exact = _logits(quantized, ids)
    torch.testing.assert_close(exact, reference, rtol=1e-4, atol=1e-4)
    assert float((served - reference).abs().max()) > 0
    agreement = float((served.argmax(-1) == reference.argmax(-1)).float().mean())
    assert agreement >= 0.9


def test_demo_model_is_served_quantized_with_a_load_report(demo):
    formats = demo.report.weight_formats
    assert formats["qkv_proj"] == formats["gate_up_proj"] == formats["down_proj"] == "int4+min"  # Q4_1
    assert formats["embed_tokens"] == formats["lm_head"] == "int8"  # its Q8_0 embedding, tied head
    assert demo.model.lm_head.qweight is demo.model.model.embed_tokens.qweight  # one copy
    assert 80e6 < demo.report.weight_bytes < 120e6  # vs 538 MB as float32
    assert any("weight formats: " in line and "qkv_proj int4+min" in line for line in demo.report.lines())
    assert demo.report.to_dict()["weight_formats"] == formats


def test_float_checkpoint_quantized_at_load(tmp_path, brisk_cache):
    from test_rope_and_hf_dirs import ROPE_CASES, _hf_config, _hf_logits, _save
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(_hf_config(ROPE_CASES["default"])).eval()
    path = _save(hf, tmp_path / "hf")
    ids = list(range(1, 30))
    reference = _hf_logits(hf, ids)
    for method, fmt in (("int8", "int8"), ("int4", "int4+min")):
        loaded = load(str(path), quantization=method, max_model_len=32, warmup=False)
        assert set(loaded.report.weight_formats.values()) == {fmt}
        assert loaded.model.model.layers[0].mlp.down_proj.fmt.tiled  # both kernels read linears in tiles
        assert "lm_head" in loaded.report.weight_formats and "embed_tokens" not in loaded.report.weight_formats
        got = _logits(loaded, ids)
        rel = float((got - reference).norm() / reference.norm())
        assert rel < (0.02 if method == "int8" else 0.15), (method, rel)
    assert not load(str(path), max_model_len=32, warmup=False).report.weight_formats  # default: stays float


# ------------------------------------------------------------------ bad input

def test_int4_needs_dimensions_in_whole_groups(tmp_path, brisk_cache):
    from test_rope_and_hf_dirs import ROPE_CASES, _hf_config, _save
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(_hf_config(ROPE_CASES["default"], hidden_size=48, num_attention_heads=4,
                                     num_key_value_heads=2)).eval()
    path = _save(hf, tmp_path / "hf48")
    with pytest.raises(BriskError, match=r"--quantization int4: tensor \S+ has shape \[\d+, 48\].*"
                                         r"multiple of the group size 32.*--quantization none"):
        load(str(path), quantization="int4", max_model_len=32, warmup=False)


def test_unknown_quantization_is_named(brisk_cache):
    with pytest.raises(BriskError, match="--quantization 'fp4' is not supported; use auto, none, int8, int4"):
        load(quantization="fp4")


def test_a_model_that_cannot_fit_is_refused_before_conversion(tmp_path, monkeypatch):
    from brisk.loading import memory_plan as memory

    cache = tmp_path / "cache"
    monkeypatch.setenv("BRISK_CACHE", str(cache))
    monkeypatch.setattr(memory, "available_memory", lambda device: 300 * 2**20)
    # float32: 538 MB of weights + 8192 tokens x 46 KB of float32 KV > 300 MiB
    with pytest.raises(BriskError, match=r"does not fit: its weights take 0\.50 GiB and one 8192-token sequence of "
                                         r"KV cache 0\.35 GiB, but 0\.29 GiB of memory is available; use a smaller "
                                         r"--quantization"):
        load(quantization="none", kv_cache_dtype="float32")
    assert not (cache / "converted").exists() or not any((cache / "converted").iterdir())
    # int8 weights (143 MB) + a 2048-token window (94 MB) fit the same 300 MiB
    assert load(quantization="int8", max_model_len=2048, warmup=False).report.weight_bytes == 143025408
