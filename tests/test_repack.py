"""repack.cpp, the compiled byte moves of a GGUF conversion, against the numpy/torch functions it was
written from (brisk.loading.dequant, brisk.kernels.tile_*), byte for byte; and a whole conversion with
and without it. The references themselves are held to `gguf.quants.dequantize` by test_dequant.py and
test_quant.py."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from brisk import kernels
from brisk.loading import repack
from brisk.loading.dequant import _split_nibbles_64, nibbles_64_as_32s
from brisk.loading.gguf_convert import convert
from brisk.loading.gguf_random import Shape, write_random_gguf

compiled = pytest.mark.skipif(kernels.library() is None, reason="brisk's kernels are not built")
BLOCK_BYTES = {6: 210, 5: 176, 3: 110, 2: 84}


def random_bytes(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


@compiled
@pytest.mark.parametrize("bits", [6, 5, 3, 2])
def test_k_quant_values_match_the_numpy_reference(bits):
    """Random bytes are valid blocks: every bit pattern of every field is covered (37 super-blocks: not a
    multiple of anything the threads split by)."""
    blocks = random_bytes(37, BLOCK_BYTES[bits], seed=bits)
    ours = repack.k_quant_values(blocks, bits)
    reference = repack.k_quant_values(blocks, bits, compiled=False)
    assert ours.shape == (37, 256) and ours.dtype == np.uint8
    assert np.array_equal(ours, reference)
    assert int(ours.max()) == (1 << bits) - 1  # the values use every bit


@compiled
def test_k4_codes_match_the_numpy_reference():
    blocks = random_bytes(41, 144, seed=4)
    assert np.array_equal(repack.k4_codes(blocks, 16), repack.k4_codes(blocks, 16, compiled=False))


@compiled
def test_k4_scales_match_the_numpy_reference():
    blocks = random_bytes(43, 176, seed=6)  # Q5_K's size: the scales sit where Q4_K's do
    ours, reference = repack.k4_scales(blocks), repack.k4_scales(blocks, compiled=False)
    for a, b in zip(ours, reference):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_nibbles_64_as_32s_is_split_then_pack():
    """The numpy reference against the two steps it replaces: each 64-weight chunk split into its values,
    then packed in Q4_0's order (byte j: weight j | weight j + 16 << 4)."""
    qs = random_bytes(9, 128, seed=5)
    values = torch.from_numpy(_split_nibbles_64(qs).reshape(9, 256))
    assert np.array_equal(nibbles_64_as_32s(qs).reshape(9, 128), kernels.pack_int4(values).numpy())


@compiled
@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_tile_values_match_the_torch_reference(bits):
    q = torch.from_numpy(random_bytes(24, 96, seed=bits) & ((1 << bits) - 1))
    ours = kernels.tile_values(q, bits)
    assert ours.shape == (3, 3, kernels.TILE_BYTES[bits])
    assert torch.equal(ours, kernels.tile_values(q, bits, compiled=False))
    assert torch.equal(kernels.untile_values(ours, bits), q)


@compiled
@pytest.mark.parametrize("block_bytes,head_bytes", [(18, 2), (20, 4), (34, 2)])  # Q4_0/IQ4_NL, Q4_1, Q8_0
def test_split_blocks_match_the_numpy_reference(block_bytes, head_bytes):
    blocks = random_bytes(29 * block_bytes, seed=block_bytes)
    ours = repack.split_blocks(blocks, block_bytes, head_bytes)
    reference = repack.split_blocks(blocks, block_bytes, head_bytes, compiled=False)
    assert ours[0].shape == (29, head_bytes) and ours[1].shape == (29, block_bytes - head_bytes)
    assert all(np.array_equal(a, b) for a, b in zip(ours, reference))


@compiled
@pytest.mark.parametrize("tiler", [kernels.tile_int4, kernels.tile_int8])
def test_word_tiling_matches_the_torch_reference(tiler):
    width = 96 // 2 if tiler is kernels.tile_int4 else 96
    q = torch.from_numpy(random_bytes(24, width, seed=width))
    q = q if tiler is kernels.tile_int4 else q.view(torch.int8)
    scales = torch.rand(24, 3).half()
    ours, reference = tiler(q, scales, None), tiler(q, scales, None, compiled=False)
    assert ours[0].dtype == q.dtype and torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])


@compiled
def test_tile_values_refuses_rows_that_do_not_fill_tiles():
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        kernels.tile_values(torch.zeros(12, 64, dtype=torch.uint8), 6)


def _converted_digest(path, out) -> str:
    convert(path, out)
    digest = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()


@compiled
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q2_K_mix", "Q3_K_M", "Q4_1", "Q8_0", "IQ4_NL"])
def test_conversion_writes_the_same_bytes_without_the_compiled_repack(tmp_path, monkeypatch, mix):
    """Every K-quant type (Q2_K-Q6_K) and the blocks of 32 through a whole conversion, once with repack.cpp and
    once with the numpy/torch functions alone: the same checkpoint, byte for byte. A 132-token vocabulary leaves the
    embeddings' rows out of whole tiles (their other path)."""
    shape = Shape(hidden=256, layers=1, ffn=512, heads=4, kv_heads=2)
    path = write_random_gguf(tmp_path / f"{mix}.gguf", shape, mix, None, small_vocab=132)
    ours = _converted_digest(path, tmp_path / "compiled")
    monkeypatch.setattr(kernels, "library", lambda: None)
    assert _converted_digest(path, tmp_path / "reference") == ours
