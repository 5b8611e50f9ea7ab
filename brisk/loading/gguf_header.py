"""A GGUF file's header in milliseconds, its tensors as views of the file, and the HF-style config
its metadata maps to; torch-free. The one GGUF parser brisk has.

`read_gguf_header` parses the key-value section and the tensor infos straight from a memory map.
Without `contents`, arrays are `range(n)` (their length, e.g. the vocabulary size): what the
pre-flight checks and the memory plan need before anything loads. With it, arrays are read too
(numbers with numpy, strings in one pass): the converter's reading of a 262k-token vocabulary
takes ~0.5 s this way, where the `gguf` package's reader took 26 s building an object per item.
`GGUFFile` adds the tensor data as zero-copy uint8 views of the memory-mapped file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from brisk.errors import ModelLoadError
from brisk.families import UNSUPPORTED, expert_keys, gguf_architectures, gguf_family
from brisk.loading.pooling import CONFIG_KEY as POOLING_KEY, from_gguf

# GGUF value types: (struct format, size) for the fixed-size ones
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32

BRISK_LAYOUT = "brisk-fused-v1"

@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # the GGML type ("Q4_K", "F32"), or "type N" for one the gguf package does not know
    dims: tuple[int, ...]  # GGUF order: the contiguous dimension first
    offset: int  # bytes from the start of the data section
    nbytes: int | None  # None for an unknown type

    @property
    def shape(self) -> tuple[int, ...]:
        """In HF orientation: [out_features, in_features] for a weight."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_start: int  # file offset of the tensor data section


def read_gguf_header(path: str | Path, contents: bool = False) -> GGUFHeader:
    """The metadata and tensor infos. Raises ModelLoadError for a file that is not GGUF or is cut short."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, str(path), contents)
    except OSError as e:  # the operating system's reason (no such file, permission, empty file)
        raise ModelLoadError(f"{path}: cannot read the file ({e.strerror or e}); check the path") from None
    except (ValueError, struct.error, UnicodeDecodeError):  # the parser ran off the end or met nonsense
        raise ModelLoadError(f"{path}: its GGUF header is cut short or corrupt ({path.stat().st_size:,} bytes); "
                             "the file is truncated or damaged — download it again") from None


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """{key: value}; arrays are `range(n)` (their length, without the contents)."""
    return read_gguf_header(path).metadata


def _parse(buf, source: str, contents: bool) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{source}: not a GGUF file (it does not start with 'GGUF')")
    version = struct.unpack_from("<I", buf, 4)[0]
    if version < 2:
        raise ModelLoadError(f"{source}: GGUF version {version} is too old (brisk reads 2 and 3)")
    num_tensors, kv_count = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    meta: dict[str, Any] = {}

    def string(at: int) -> tuple[str, int]:
        n = struct.unpack_from("<Q", buf, at)[0]
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n

    def value(kind: int, at: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            return struct.unpack_from(fmt, buf, at)[0], at + size
        if kind == _STRING:
            return string(at)
        if kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALARS:
                end = at + n * _SCALARS[item][1]
                if end > len(buf):
                    raise ValueError("an array runs past the end of the file")
                items = np.frombuffer(buf, dtype=_NUMPY[item], count=n, offset=at).tolist() if contents else range(n)
                return items, end
            items = []
            for _ in range(n):  # strings (or nested arrays)
                item_value, at = value(item, at)
                if contents:
                    items.append(item_value)
            return (items if contents else range(n)), at
        raise ValueError(f"unknown GGUF value type {kind}")

    for _ in range(kv_count):
        key, pos = string(pos)
        kind = struct.unpack_from("<I", buf, pos)[0]
        meta[key], pos = value(kind, pos + 4)
        if pos > len(buf):
            raise ValueError("metadata runs past the end of the file")
    tensors = []
    for _ in range(num_tensors):
        name, pos = string(pos)
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append(_tensor_info(name, kind, tuple(int(d) for d in dims), offset))
    alignment = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    return GGUFHeader(meta, tensors, -(-pos // alignment) * alignment)


def _tensor_info(name: str, kind: int, dims: tuple[int, ...], offset: int) -> TensorInfo:
    import gguf  # its table of block sizes; importing it costs ~30 ms

    if kind not in gguf.GGMLQuantizationType._value2member_map_:
        return TensorInfo(name, f"type {kind}", dims, offset, None)
    qtype = gguf.GGMLQuantizationType(kind)
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    numel = 1
    for d in dims:
        numel *= d
    return TensorInfo(name, qtype.name, dims, offset, numel // block * type_bytes)


class GGUFFile:
    """A GGUF's header with its arrays, and its tensors' bytes as views of the memory-mapped file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header = read_gguf_header(self.path, contents=True)
        self.metadata, self.tensors = header.metadata, header.tensors
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        end = header.data_start + max((t.offset + (t.nbytes or 0) for t in self.tensors), default=0)
        if self.tensors and end > len(self._data):
            raise ModelLoadError(f"{self.path}: its tensors run {end - len(self._data)} bytes past the end of the "
                                 "file; it is truncated — re-download it")
        self._start = header.data_start

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes (uint8, zero-copy)."""
        if tensor.nbytes is None:
            raise ModelLoadError(f"{self.path}: tensor {tensor.name} has an unknown GGML {tensor.type_name}")
        start = self._start + tensor.offset
        return self._data[start:start + tensor.nbytes]


def hf_config(meta: dict[str, Any], has_output: bool, source: str) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    family = gguf_family(arch, int(meta.get(f"{arch}.expert_count") or 0))
    if family is None:
        what = f" ({UNSUPPORTED[arch]} is not implemented)" if arch in UNSUPPORTED else ""
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {arch!r}{what}; brisk converts {', '.join(gguf_architectures())}"
        )

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None and required:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{name}; the file is incomplete")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    config = {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "vocab_size": int(key("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or None)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", 0 if family.experts else None)),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "brisk_layout": BRISK_LAYOUT,
    }
    layers = config["num_hidden_layers"]
    window = key("attention.sliding_window", None, required=False)
    pattern = family.gguf_sliding_pattern
    if window:  # llama.cpp's key: the windowed layers attend to the last `window` positions
        config["sliding_window"] = int(window)
        config["use_sliding_window"] = True
        # every layer, unless the family interleaves global ones
        config["layer_types"] = ["sliding_attention" if pattern is None or (i + 1) % pattern else "full_attention"
                                 for i in range(layers)]
    elif pattern is not None:
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * layers
    rope_dims = key("rope.dimension_count", None, required=False)
    if rope_dims and int(rope_dims) != config["head_dim"]:
        config["partial_rotary_factor"] = int(rope_dims) / config["head_dim"]
    if family.gguf_keys is not None:
        config.update(family.gguf_keys(key, config))
    embedding = from_gguf(arch, meta, source)
    if embedding is not None:
        config[POOLING_KEY] = embedding
    if family.experts is not None:
        config.update(expert_keys(family, key, config))
        if not config["intermediate_size"]:
            config["intermediate_size"] = config["moe_intermediate_size"]
    scaling = key("rope.scaling.type", None, required=False)
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(
                key("rope.scaling.original_context_length", config["max_position_embeddings"])
            ),
        }
        for beta in ("beta_fast", "beta_slow"):  # YaRN's ramp (llama.cpp's defaults, 32 and 1, where absent)
            value = key(f"rope.scaling.yarn_{beta}", None, required=False)
            if value is not None:
                config["rope_scaling"][beta] = float(value)
    return config
