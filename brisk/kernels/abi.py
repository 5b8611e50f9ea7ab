"""The compiled kernels' C interface as ctypes sees it: every signature and struct of
`brisk_abi.h`, in one place, in the header's order. `declare(lib)` sets them on a loaded library.
Torch-free."""

from __future__ import annotations

import ctypes

_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class QuantWeight(ctypes.Structure):  # BriskQuantWeight
    _fields_ = [("q", _p), ("d", _p), ("m", _p), ("sub", _p), ("bias", _p), ("bits", _i64), ("n", _i64), ("k", _i64),
                ("tiled", _i64), ("half", _i64)]


class ExpertWeight(ctypes.Structure):  # BriskExpertWeight
    _fields_ = [("w", QuantWeight), ("q_stride", _i64), ("d_stride", _i64), ("m_stride", _i64), ("sub_stride", _i64)]


class Experts(ctypes.Structure):  # BriskExperts
    _fields_ = [("router", _p), ("gate_up", ExpertWeight), ("down", ExpertWeight), ("num", _i64), ("top_k", _i64),
                ("renorm", _i64), ("router_bias", _p), ("gate_up_bias", _p), ("down_bias", _p), ("oai", _i64),
                ("swiglu_alpha", _f32), ("swiglu_limit", _f32)]


class Layer(ctypes.Structure):  # BriskLayer
    _fields_ = [("qkv", QuantWeight), ("o", QuantWeight), ("gate_up", QuantWeight), ("down", QuantWeight),
                ("qkv_rest", QuantWeight), ("input_norm", _p), ("post_norm", _p), ("k_cache", _p), ("v_cache", _p), ("k_scale", _p), ("v_scale", _p),
                ("window", _i64), ("qk_norm", _i64), ("q_norm", _p), ("k_norm", _p), ("moe", Experts), ("sinks", _p)]


class Dims(ctypes.Structure):  # BriskDims
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("rot_dim", _i64),
                ("inter", _i64), ("kv_dtype", _i64), ("block_size", _i64), ("part_tokens", _i64),
                ("eps", _f32), ("scale", _f32)]


class Scratch(ctypes.Structure):  # BriskScratch
    _fields_ = [(name, _p) for name in ("x", "qkv", "q", "attn", "proj", "gate_up", "act", "xq", "xd", "xs", "xn")]


# name -> (argument types, return type), as brisk_abi.h declares them
SIGNATURES = {
    "brisk_quant_matmul": ([_p, _p, _p, _p, _p, _i32, _i32, _i64, _i64, _i64, _p, _p, _p, _p, _p], None),
    "brisk_quant_matmul_experts": ([_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _p, _p, _i64, _i32, _i64, _i64, _p, _p,
                                    _p, _p, _p], _i32),
    "brisk_kernels_isa": ([], _i32),
    "brisk_moe_route": ([_p, _p, _p, _i64, _i64, _i64, _i64, _i32, _p, _p], None),
    "brisk_moe_block": ([ctypes.POINTER(Experts), _p, _i64, _p], _i32),
    "brisk_kernels_force_isa": ([_i32], None),
    "brisk_half_matmul": ([_p, _p, _i32, _i64, _i64, _i64, _p], _i32),
    "brisk_half_matmul_panels": ([_p, _p, _i32, _i64, _i64, _i64, _p], _i32),
    "brisk_paged_decode_attention": ([_p, _p, _p, _i32, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32,
                                      _i64, _i64, _f32, _p, _p], _i32),
    "brisk_paged_attention_isa": ([], _i32),
    "brisk_paged_attention_force_isa": ([_i32], None),
    "brisk_paged_attention_staged": ([_i32], _i32),
    "brisk_rms_norm": ([_p, _p, _p, _p, _i64, _i64, _f32], None),
    "brisk_silu_mul": ([_p, _p, _i64, _i64], None),
    "brisk_rope": ([_p, _i64, _p, _p, _i64, _i64, _i64, _i64], None),
    "brisk_store_kv": ([_p, _p, _i64, _p, _p, _p, _p, _p, _i32, _i64, _i64, _i64], None),
    "brisk_decode_stack": ([ctypes.POINTER(Layer), _i64, ctypes.POINTER(Dims), _p, _p, _p, _p, _p, _p, _i64, _p, _i64,
                            ctypes.POINTER(Scratch), _p], _i32),
    "brisk_k_quant_values": ([_p, _i32, _i64, _p], _i32),
    "brisk_k4_codes": ([_p, _i64, _i64, _i64, _p], None),
    "brisk_split_blocks": ([_p, _i64, _i64, _i64, _p, _p], None),
    "brisk_tile_words": ([_p, _i64, _i64, _i64, _p], None),
    "brisk_k4_scales": ([_p, _i64, _i64, _p, _p, _p], None),
    "brisk_tile_values": ([_p, _i64, _i64, _i32, _p], _i32),
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib
