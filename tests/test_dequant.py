"""Every dequantizer against the `gguf` package's reference implementation."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from brisk.loading.dequant import DEQUANTIZERS

# byte offsets of the float16 scale fields inside one block of each type
_F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def _random_blocks(name: str, num_blocks: int, rng) -> np.ndarray:
    """Random bits in every quant field, finite float16 values in the scale fields."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[QT[name]]
    raw = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in _F16_FIELDS.get(name, ()):
        scales = rng.uniform(-2, 2, num_blocks).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    if name in ("F16", "BF16", "F32"):
        values = rng.standard_normal(raw.size).astype(np.float32)  # more than enough bytes
        converted = {"F32": values, "F16": values.astype(np.float16)}.get(name)
        if converted is None:  # BF16: the top half of float32
            converted = (values.view(np.uint32) >> 16).astype(np.uint16)
        raw = np.frombuffer(converted.tobytes(), dtype=np.uint8)[: raw.size].reshape(raw.shape)
    return raw


@pytest.mark.parametrize("name", sorted(DEQUANTIZERS))
def test_random_blocks_match_reference(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    raw = _random_blocks(name, 96, rng)
    expected = dequantize(raw, QT[name]).reshape(-1)
    np.testing.assert_array_equal(DEQUANTIZERS[name](raw), expected)


@pytest.fixture(scope="module")
def demo_reader(demo_gguf_path):
    return gguf.GGUFReader(str(demo_gguf_path))  # slow to open (49k-entry tokenizer arrays): once


def test_demo_model_tensors_match_reference(demo_reader):
    """Real tensors: every Q4_1, Q8_0 and F32 tensor of the demo GGUF, bit for bit."""
    seen = set()
    for tensor in demo_reader.tensors:
        name = tensor.tensor_type.name
        seen.add(name)
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        np.testing.assert_array_equal(DEQUANTIZERS[name](tensor.data), expected, err_msg=tensor.name)
    assert {"Q4_1", "Q8_0", "F32"} <= seen


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_requantized_real_weights_match_reference(name, demo_reader):
    """Real weight values quantized by gguf's own quantizer, then dequantized by both."""
    tensor = next(t for t in demo_reader.tensors if t.name == "blk.0.attn_q.weight")
    weights = dequantize(tensor.data, tensor.tensor_type)
    packed = quantize(weights, QT[name])
    np.testing.assert_array_equal(
        DEQUANTIZERS[name](packed).reshape(weights.shape), dequantize(packed, QT[name]))


def test_partial_block_is_rejected():
    with pytest.raises(ValueError, match="whole number"):
        DEQUANTIZERS["Q8_0"](np.zeros(35, dtype=np.uint8))
