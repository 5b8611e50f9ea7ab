"""A decoder layer's small operations, one compiled call each (`fused_ops.cpp`), with the PyTorch
math beside them: the path on other devices and dtypes, without the library, and the oracle the
tests hold the compiled path to.

At one decode row these ops touch a few hundred floats each, and a chain of PyTorch ops costs
more in dispatch than in math (RMSNorm alone is ~6 ops). The compiled path applies to float32
CPU tensors laid out as the model makes them (rows contiguous); anything else takes the torch
math, with the same results up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from brisk.kernels import kv_code, kv_codec, library, scale_pointers
from brisk.kv_dtype import DTYPES, KVDtype


def _cpu_f32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., dim]; with `residual`, first `residual += x` (in place) and normalize that."""
    lib = library()
    if lib is not None and _cpu_f32(x, weight) and (residual is None or _cpu_f32(residual)):
        dim = x.shape[-1]
        out = torch.empty_like(x)
        lib.brisk_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), x.numel() // dim, dim, eps)
        return out
    return reference_rms_norm(x, weight, eps, residual)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        x = residual.add_(x)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * inter] (gate, then up) -> silu(gate) * up [T, inter]."""
    lib = library()
    if lib is not None and gate_up.dim() == 2 and _cpu_f32(gate_up):
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        lib.brisk_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
        return out
    return reference_silu_mul(gate_up)


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> None:
    """Rotate, in place, the first `heads` heads of each row of x [T, width] (rotate-half layout,
    the first rot_dim of each head); cos, sin: [T, rot_dim // 2] for each row's position."""
    lib = library()
    if (lib is not None and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"
            and x.dtype == torch.float32 and _cpu_f32(cos, sin)):
        lib.brisk_rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], heads, head_dim,
                       rot_dim)
        return
    reference_rope_(x, heads, head_dim, cos, sin, rot_dim)


def reference_rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                    rot_dim: int) -> None:
    view = x[:, :heads * head_dim].view(x.shape[0], heads, head_dim)
    half = rot_dim // 2
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    x1, x2 = view[..., :half], view[..., half:rot_dim]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    view[..., :rot_dim] = rotated


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_dtype: KVDtype | None = None, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, kv_heads, head_dim] (views into one row-major buffer, same row stride) into the
    cache's slots [num_slots, kv_heads, head_dim] at slot_mapping [T], converted to `kv_dtype`
    (None: the cache's float dtype); int8 writes each (token, head) row's scale into k_scale /
    v_scale [num_slots, kv_heads]. The compiled store and the torch one (kv_codec.encode) agree
    bit for bit."""
    lib = library()
    code = kv_code(k_cache, kv_dtype)
    pointers = scale_pointers(kv_dtype, (k_scale, v_scale), k_cache)
    if (lib is not None and code is not None and pointers is not None and k.device.type == "cpu"
            and k.dtype == torch.float32 and v.dtype == torch.float32
            and k.stride(0) == v.stride(0) and k.stride(2) == 1 and k.stride(1) == k.shape[2]
            and v.stride(2) == 1 and v.stride(1) == v.shape[2]
            and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        lib.brisk_store_kv(k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(), k_cache.data_ptr(),
                           v_cache.data_ptr(), *pointers, code, k.shape[0], k.shape[1], k.shape[2])
        return
    kv_dtype = kv_dtype or DTYPES[kv_codec.float_kv_name(k_cache.dtype)]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        stored, scale = kv_codec.encode(x, kv_dtype)
        cache.index_copy_(0, slot_mapping, stored)
        if scale is not None:
            scales.index_copy_(0, slot_mapping, scale)
