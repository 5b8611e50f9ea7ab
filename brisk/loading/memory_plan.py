"""Will the model fit? Weights as they will be stored + one max-length sequence of KV cache,
against the memory available, computed from file headers alone, before any weight is read
or converted: a model that cannot fit is refused at start with the numbers.
"""

from __future__ import annotations

from pathlib import Path

from brisk.config import host_available_memory
from brisk.errors import BriskError
from brisk.kv_dtype import KVDtype
from brisk.loading import safetensors_io
from brisk.loading.dequant import check_type
from brisk.loading.gguf_header import read_gguf_header


def gguf_weight_bytes(path: Path, quantization: str) -> tuple[int, dict]:
    """Bytes the converted weights will take once loaded, and the GGUF's scalar metadata. With
    `quantization` bf16/f16 (what `auto` picks for an all-16-bit GGUF on CPU) the 16-bit matrices
    stay 2 bytes; otherwise float tensors load as float32."""
    from brisk.loading import gguf_convert
    from brisk.models import quant

    header = read_gguf_header(path)
    half = quantization in quant.HALF_METHODS
    mode = "auto" if half else quantization
    shares_table = gguf_convert.shared_codebooks(header.tensors)
    total = 0
    for tensor in header.tensors:
        name, shape, copies = tensor.name, tensor.shape, 1
        if len(shape) == 3:  # stacked experts: each expert is stored as a [out, in] weight is
            copies, shape = shape[0], shape[1:]
        qtype = check_type(str(path), name, tensor.type_name)
        fmt = gguf_convert.target_format(name, qtype, shape, mode)
        kept = gguf_convert.kept_type(qtype, shape, mode) if half else "F32"
        for suffix, dtype in gguf_convert.stored_arrays(fmt, kept):
            numel = 1
            for dim in (shape if fmt is None else gguf_convert.stored_shape(suffix, *shape, fmt)):
                numel *= dim
            if suffix == quant.CODEBOOK and name in shares_table:
                continue  # fused into a weight whose first part stores the table
            total += numel * (1 if suffix == quant.CODEBOOK else copies) * \
                {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1}[dtype]
    return total, header.metadata


def gguf_kv_bytes_per_token(meta: dict, kv_dtype: KVDtype) -> int:
    arch = meta.get("general.architecture")
    heads = meta.get(f"{arch}.attention.head_count") or 1
    head_dim = meta.get(f"{arch}.attention.key_length") or (meta.get(f"{arch}.embedding_length") or 0) // heads
    kv_heads = meta.get(f"{arch}.attention.head_count_kv") or heads
    return 2 * (meta.get(f"{arch}.block_count") or 0) * kv_heads * kv_dtype.row_bytes(head_dim)


def checkpoint_weight_bytes(model_dir: Path, quantization: str, dtype_bytes: int) -> int:
    """Bytes of a safetensors checkpoint's weights once loaded (cast to the dtype, or quantized)."""
    from brisk.models import quant

    total = 0
    for file in safetensors_io.checkpoint_files(model_dir):
        header, _ = safetensors_io.read_header(file)
        for name, info in header.items():
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            stored = safetensors_io.DTYPES[info["dtype"]]
            if name.rpartition(".")[2] in quant.QUANT_SUFFIXES or not stored.is_floating_point:
                total += numel * stored.itemsize
            elif quantization in quant.QUANTIZERS and quant.converts(name, quantization):
                total += int(numel * quant.method_format(quantization).bits_per_weight / 8)
            else:
                total += numel * dtype_bytes
    return total


def check_fits(weight_bytes: int, kv_bytes_per_token: int, max_model_len: int, available_bytes: int,
               what: str) -> None:
    """Refuse, with the numbers, a model whose weights + one max-length sequence exceed memory."""
    kv_bytes = kv_bytes_per_token * max_model_len
    if weight_bytes + kv_bytes > available_bytes:
        raise BriskError(
            f"{what} does not fit: its weights take {weight_bytes / 2**30:.2f} GiB and one {max_model_len}-token "
            f"sequence of KV cache {kv_bytes / 2**30:.2f} GiB, but {available_bytes / 2**30:.2f} GiB of memory is "
            "available; use a smaller --quantization (int8, int4; auto keeps a GGUF quantized), a lower "
            "--max-model-len, or free memory")


def available_memory(device) -> int:
    """Free bytes on the device: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return free
    return host_available_memory()
