"""A GGUF file's metadata in milliseconds, and the HF-style config it maps to; torch-free.

`read_gguf_metadata` parses the key-value section straight from a memory map, array contents
skipped (only their lengths kept), for what needs the model's shape and window before loading
anything (`brisk serve`'s pre-flight checks, `brisk kv-plan`). The converter reads everything
with the `gguf` package and maps it with the same `hf_config`.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from brisk.errors import ModelLoadError

# GGUF value types: (struct format, size) for the fixed-size ones
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9

BRISK_LAYOUT = "brisk-fused-v1"
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """{key: value}; arrays are `range(n)` (their length, e.g. the vocabulary size, without the
    contents). Raises ModelLoadError for a file that is not GGUF or is cut short."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, str(path))
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"{path}: cannot read GGUF metadata ({e}); the file is truncated or corrupt") from None


def _parse(buf, source: str) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{source}: not a GGUF file (it does not start with 'GGUF')")
    version = struct.unpack_from("<I", buf, 4)[0]
    if version < 2:
        raise ModelLoadError(f"{source}: GGUF version {version} is too old (brisk reads 2 and 3)")
    _, kv_count = struct.unpack_from("<QQ", buf, 8)
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
                return range(n), at + n * _SCALARS[item][1]
            for _ in range(n):  # strings (or nested arrays): walk their lengths
                _, at = value(item, at)
            return range(n), at
        raise ValueError(f"unknown GGUF value type {kind}")

    for _ in range(kv_count):
        key, pos = string(pos)
        kind = struct.unpack_from("<I", buf, pos)[0]
        meta[key], pos = value(kind, pos + 4)
        if pos > len(buf):
            raise ValueError("metadata runs past the end of the file")
    return meta


def hf_config(meta: dict[str, Any], has_output: bool, source: str) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {arch!r}; brisk converts {', '.join(_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None and required:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{name}; the file is incomplete")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(key("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or None)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
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
    window = key("attention.sliding_window", None, required=False)
    if window:  # llama.cpp's key: every layer attends to the last `window` positions
        config["sliding_window"] = int(window)
        config["use_sliding_window"] = True
        config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    scaling = key("rope.scaling.type", None, required=False)
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(
                key("rope.scaling.original_context_length", config["max_position_embeddings"])
            ),
        }
    return config
