"""GGUF -> brisk's converted cache (safetensors + config.json + tokenizer files).

The first start with a GGUF file dequantizes it once and writes a converted copy
into the cache directory, keyed by the file's size, mtime and a hash of its first
MiB; every later start memory-maps that copy (zero-copy) instead. Tensors are
written one at a time by a streaming safetensors writer, so memory stays bounded
by the largest (fused) tensor, and the result appears atomically (temp dir, rename).

The converted safetensors use brisk's layout: q/k/v and gate/up already fused
(`qkv_proj`, `gate_up_proj`), so a warm start does no copy at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from brisk.errors import ModelLoadError
from brisk.loading.dequant import DEQUANTIZERS
from brisk.loading.gguf_tokenizer import build_tokenizer

CONVERT_VERSION = 1
BRISK_LAYOUT = "brisk-fused-v1"
_HASHED_PREFIX_BYTES = 1 << 20

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_PLAIN_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# fused output name -> GGUF parts in order
_FUSED = {
    "self_attn.qkv_proj.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "self_attn.qkv_proj.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "mlp.gate_up_proj.weight": ("ffn_gate.weight", "ffn_up.weight"),
}


def cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_HASHED_PREFIX_BYTES))
    h.update(f"{st.st_size}:{st.st_mtime_ns}:{CONVERT_VERSION}".encode())
    return h.hexdigest()[:16]


def converted_dir(cache_root: Path, gguf_path: Path) -> Path:
    return cache_root / "converted" / f"{gguf_path.stem}-{cache_key(gguf_path)}"


def open_gguf(path: Path):
    import gguf  # deferred: only needed on a cache miss

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/IndexError/struct.error on bad files
        raise ModelLoadError(
            f"{path}: cannot read GGUF ({type(e).__name__}: {e}); the file is truncated or corrupt — re-download it"
        ) from None


def read_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
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


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Tensors:
    """Lazily dequantized GGUF tensors in HF orientation ([out, in])."""

    def __init__(self, reader, config: dict[str, Any], source: str):
        self.by_name = {t.name: t for t in reader.tensors}
        self.config = config
        self.source = source
        self.permute = config["model_type"] == "llama"

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.by_name[name].shape))

    def load(self, name: str) -> np.ndarray:
        t = self.by_name[name]
        qtype = t.tensor_type.name
        if qtype not in DEQUANTIZERS:
            raise ModelLoadError(
                f"{self.source}: tensor {name} uses quantization {qtype}, which brisk cannot dequantize "
                f"(supported: {', '.join(DEQUANTIZERS)})"
            )
        values = DEQUANTIZERS[qtype](np.asarray(t.data)).reshape(self.shape(name))
        if self.permute and name.endswith(("attn_q.weight", "attn_q.bias")):
            values = _unpermute(values, self.config["num_attention_heads"])
        elif self.permute and name.endswith(("attn_k.weight", "attn_k.bias")):
            values = _unpermute(values, self.config["num_key_value_heads"])
        return values


def _plan(tensors: _Tensors, num_layers: int) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(output name, shape, producer) for every tensor of the converted checkpoint."""
    plan = []
    for gguf_name, hf_name in _PLAIN_NAMES.items():
        if gguf_name in tensors.by_name:
            plan.append((hf_name, tensors.shape(gguf_name), lambda n=gguf_name: tensors.load(n)))
    for i in range(num_layers):
        prefix = f"blk.{i}."
        for part, hf_part in _LAYER_NAMES.items():
            plan.append((f"model.layers.{i}.{hf_part}", tensors.shape(prefix + part),
                         lambda n=prefix + part: tensors.load(n)))
        for hf_part, parts in _FUSED.items():
            names = [prefix + p for p in parts]
            present = [n in tensors.by_name for n in names]
            if not any(present):
                continue
            if not all(present):
                missing = [n for n, p in zip(names, present) if not p]
                raise ModelLoadError(f"{tensors.source}: GGUF lacks tensor(s) {', '.join(missing)}")
            shapes = [tensors.shape(n) for n in names]
            shape = (sum(s[0] for s in shapes), *shapes[0][1:])
            plan.append((f"model.layers.{i}.{hf_part}", shape,
                         lambda ns=names: np.concatenate([tensors.load(n) for n in ns], axis=0)))
    return plan


def _write_safetensors(path: Path, plan, metadata: dict[str, str]) -> int:
    """Stream float32 tensors into a safetensors file: header first, then each tensor in turn."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape, _ in plan:
        nbytes = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, produce in plan:
            values = np.ascontiguousarray(produce(), dtype=np.float32)
            if values.shape != tuple(shape):
                raise ModelLoadError(f"tensor {name}: expected shape {shape}, got {values.shape}")
            f.write(values.tobytes())
    return offset


def convert(gguf_path: Path, out_dir: Path) -> dict[str, float]:
    """Convert `gguf_path` into `out_dir` (created atomically). Returns phase timings in ms."""
    import time

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    source = str(gguf_path)
    config = hf_config(meta, has_output="output.weight" in {t.name for t in reader.tensors}, source=source)
    fast_tokenizer, tok_config = build_tokenizer(meta, source)
    tensors = _Tensors(reader, config, source)
    plan = _plan(tensors, config["num_hidden_layers"])
    timings["gguf_read"] = (time.perf_counter() - t0) * 1e3

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    try:
        t1 = time.perf_counter()
        _write_safetensors(tmp / "model.safetensors", plan, {"format": "pt", "brisk_layout": BRISK_LAYOUT})
        timings["dequantize_write"] = (time.perf_counter() - t1) * 1e3
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok_config["model_max_length"] = config["max_position_embeddings"]
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tok_config, indent=2, ensure_ascii=False), encoding="utf-8")
        fast_tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "brisk_source.json").write_text(json.dumps(
            {"gguf": source, "size": gguf_path.stat().st_size, "convert_version": CONVERT_VERSION}, indent=2))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():  # not a concurrent winner: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return timings

