"""The compiled per-layer ops (brisk/kernels/fused_ops.cpp) against the PyTorch math they replace
(brisk/kernels/fused.py's reference_* functions, which are plain torch ops).

Tolerances: RMSNorm differs only in the order of its float32 sum of squares (a few ulps of the
scale: 2e-6 relative); RoPE computes the same products and one subtraction or addition each, with
no fused multiply-add, so it is exact; SiLU uses an exp polynomial with < 2e-7 relative error
(the result's relative error stays within 1e-6); the K/V store is a copy, and bfloat16 rounding is
PyTorch's own round-to-nearest-even, so both are exact."""

import pytest
import torch

from brisk import kernels
from brisk.kernels import fused

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="compiled kernels not built")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 2048), (300, 64), (3, 40)])
def test_rms_norm_with_and_without_the_residual_add(rows, dim):
    g = _gen(rows)
    x, res, w = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g), torch.randn(dim, generator=g)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), fused.reference_rms_norm(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    ours_res, ref_res = res.clone(), res.clone()
    ours = fused.rms_norm(x, w, 1e-6, ours_res)
    ref = fused.reference_rms_norm(x, w, 1e-6, ref_res)
    assert torch.equal(ours_res, ref_res)  # residual += x, in place, exactly
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=1e-6)


def test_rms_norm_of_a_row_does_not_depend_on_the_batch():
    g = _gen(1)
    x, w = torch.randn(64, 576, generator=g), torch.randn(576, generator=g)
    batch = fused.rms_norm(x, w, 1e-5)  # 64 x 576 crosses the threshold where rows spread over threads
    for r in (0, 17, 63):
        assert torch.equal(fused.rms_norm(x[r:r + 1].clone(), w, 1e-5)[0], batch[r])


@pytest.mark.parametrize("rows,inter", [(1, 5632), (3, 1536), (70, 100), (2, 7)])
def test_silu_mul_matches_torch(rows, inter):
    g = _gen(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 8
    gate_up[0, :5] = torch.tensor([100.0, -100.0, 0.0, 88.5, -88.5])[:min(5, inter)]
    ours, ref = fused.silu_mul(gate_up), fused.reference_silu_mul(gate_up)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads,head_dim,rot_dim", [(12, 64, 64), (36, 64, 64), (6, 80, 40), (3, 128, 128)])
def test_rope_rotates_in_place_exactly_as_torch(heads, head_dim, rot_dim):
    g = _gen(heads)
    rows, extra = 9, 2 * head_dim  # rows carry heads beyond the rotated ones (v), left untouched
    x = torch.randn(rows, heads * head_dim + extra, generator=g)
    cos, sin = torch.randn(rows, rot_dim // 2, generator=g), torch.randn(rows, rot_dim // 2, generator=g)
    ours, ref = x.clone(), x.clone()
    fused.rope_(ours, heads, head_dim, cos, sin, rot_dim)
    fused.reference_rope_(ref, heads, head_dim, cos, sin, rot_dim)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[:, heads * head_dim:], x[:, heads * head_dim:])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_slots_like_index_copy(cache_dtype):
    g = _gen(3)
    rows, kv_heads, dim, q_width = 6, 2, 8, 32
    qkv = torch.randn(rows, q_width + 2 * kv_heads * dim, generator=g)
    qkv[0, q_width] = float("nan")  # NaN stays NaN in bfloat16
    k = qkv[:, q_width:q_width + kv_heads * dim].view(rows, kv_heads, dim)
    v = qkv[:, q_width + kv_heads * dim:].view(rows, kv_heads, dim)
    slots = torch.tensor([5, 0, 17, 3, 9, 30])
    ours_k = torch.zeros(32, kv_heads, dim, dtype=cache_dtype)
    ours_v = torch.zeros_like(ours_k)
    fused.store_kv(k, v, ours_k, ours_v, slots)
    ref_k, ref_v = torch.zeros_like(ours_k), torch.zeros_like(ours_v)
    ref_k.index_copy_(0, slots, k.to(cache_dtype))
    ref_v.index_copy_(0, slots, v.to(cache_dtype))
    assert torch.equal(ours_k.isnan(), ref_k.isnan()) and ours_k.isnan().sum() == 1  # NaN's bits may differ
    assert torch.equal(ours_k.nan_to_num(0.0), ref_k.nan_to_num(0.0))
    assert torch.equal(ours_v, ref_v)


def test_other_dtypes_take_the_torch_math():
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(fused.rms_norm(x, w, 1e-5), fused.reference_rms_norm(x, w, 1e-5))
    assert torch.equal(fused.silu_mul(x), fused.reference_silu_mul(x))
