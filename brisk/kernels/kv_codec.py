"""The KV cache's element types in torch: how each is stored, and the reference conversions.
`encode` is what the compiled store (brisk/kernels/kv_types.h) is tested against bit for bit, and
what the torch path writes with; `decode` widens what the torch path reads back. fp8 is stored as
uint8 (torch has no CPU index_copy_ for float8) and viewed as torch's float8 types to convert."""

from __future__ import annotations

import torch

from brisk.kv_dtype import KVDtype

_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8, "int8": torch.int8}
_FLOAT8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_BY_TORCH = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def storage_dtype(kv: KVDtype) -> torch.dtype:
    return _STORAGE[kv.name]


def float_kv_name(dtype: torch.dtype) -> str | None:
    """The KV dtype name of a float torch dtype (float32, bfloat16, float16), else None."""
    return _BY_TORCH.get(dtype)


def encode(x: torch.Tensor, kv: KVDtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., head_dim] -> (elements in storage_dtype, scales [...] float32 for int8 else None).
    Narrow floats round to nearest even and saturate at their largest finite value; int8 takes
    scale = max |x| / 127 per row and q = round-half-even(x / scale)."""
    if kv.scaled:
        x = x.float()
        # divided by a tensor: CUDA divides by a Python number as a multiply by its reciprocal, an
        # ulp off the quotient the compiled store (and torch on CPU) computes
        scale = x.abs().amax(dim=-1) / torch.full((), 127.0, device=x.device)
        q = torch.where(scale[..., None] > 0, torch.round(x / scale[..., None]), torch.zeros((), dtype=x.dtype))
        return q.clamp(-127, 127).to(torch.int8), scale
    if kv.max_value is not None:
        x = x.float().clamp(-kv.max_value, kv.max_value)
    if kv.name in _FLOAT8:
        return x.to(_FLOAT8[kv.name]).view(torch.uint8), None
    return x.to(_STORAGE[kv.name]), None


def decode(stored: torch.Tensor, scales: torch.Tensor | None, kv: KVDtype, dtype: torch.dtype) -> torch.Tensor:
    """The inverse widening: elements (and int8's scales) -> values in `dtype`."""
    if kv.scaled:
        return (stored.float() * scales[..., None]).to(dtype)
    if kv.name in _FLOAT8:
        return stored.view(_FLOAT8[kv.name]).to(dtype)
    return stored.to(dtype)
