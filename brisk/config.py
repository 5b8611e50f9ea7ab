"""Frozen configuration dataclasses, validated in one place, with no I/O.

`ModelConfig` is built from a Hugging Face `config.json` dict. Required keys that
are missing, or architectures brisk cannot run, raise `ModelLoadError` naming the
file and the key, so a user knows which file to fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from brisk.errors import ModelLoadError

# HF architecture name -> whether q/k/v projections carry a bias by default.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# --quantization: auto (a GGUF keeps its quantized types; float checkpoints stay float), none
# (everything float), int8 / int4 (every weight matrix quantized in blocks of 32 at load)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters in HF's semantics (`rope_type` plus its own keys)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    # Type-specific extras (low_freq_factor, beta_fast, original_max_position_embeddings, ...)
    extra: dict[str, Any] = field(default_factory=dict)
    # llama.cpp's per-frequency divisors (a GGUF's `rope_freqs.weight`: Llama 3.1+'s llama3 scaling
    # as the converter stores it), applied on top of `rope_type`: inv_freq[i] / freq_factors[i]
    freq_factors: tuple[float, ...] | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a windowed layer's position i sees positions i - W + 1 .. i only.
    # layer_windows[i] is layer i's W, or None for full attention; () when no layer has a window.
    layer_windows: tuple[int | None, ...] = ()

    @property
    def kv_window(self) -> int | None:
        """W when every layer is windowed (K/V older than the window is never read again and its
        blocks can be freed); None when any layer attends to the whole context."""
        if self.layer_windows and all(w is not None for w in self.layer_windows):
            return max(self.layer_windows)
        return None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or [_MODEL_TYPES.get(d.get("model_type"), d.get("model_type"))]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or d.get('model_type')!r}; "
                f"brisk runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ModelLoadError(
                f"{source}: missing required key(s) {', '.join(missing)}; "
                "the file is incomplete — re-export the model's config.json"
            )
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = int(d.get("head_dim") or hidden // num_heads)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qkv_bias = bool(d.get("attention_bias", SUPPORTED_ARCHITECTURES[arch]))
        if arch == "Qwen2ForCausalLM":
            qkv_bias = True
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            rope=_rope_from_hf(d, source),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_windows=_windows_from_hf(d, arch, int(d["num_hidden_layers"]), source),
        )


def _windows_from_hf(d: dict[str, Any], arch: str, num_layers: int, source: str) -> tuple[int | None, ...]:
    """Per-layer sliding windows with transformers' semantics: an explicit `layer_types` list wins;
    otherwise Mistral windows every layer with `sliding_window` (its config class defaults to
    4096 when the key is absent; null means none), Qwen2 windows layers >= `max_window_layers`
    when `use_sliding_window` is true, and Llama has no window."""
    if arch == "MistralForCausalLM":
        window = d.get("sliding_window", 4096)
    elif arch == "Qwen2ForCausalLM":
        window = d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None
    else:
        window = d.get("sliding_window")
    types = d.get("layer_types")
    if types is None:
        if window is None:
            return ()
        first = int(d.get("max_window_layers", 28)) if arch == "Qwen2ForCausalLM" else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelLoadError(f"{source}: layer_types must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ModelLoadError(f"{source}: layer_types {', '.join(map(str, unknown))} are not supported; brisk runs "
                             "full_attention and sliding_attention layers")
    if "sliding_attention" not in types:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"{source}: sliding_window must be a positive integer for sliding_attention layers, "
                             f"got {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _rope_from_hf(d: dict[str, Any], source: str) -> RopeConfig:
    """Read RoPE settings from either HF v5 `rope_parameters` or older `rope_scaling`."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported RoPE type {rope_type!r}; brisk supports {', '.join(ROPE_TYPES)}"
        )
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    factor = float(params.pop("factor", 1.0) or 1.0)
    partial = float(params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if rope_type in ("linear", "dynamic", "llama3", "yarn") and "factor" not in (
        d.get("rope_parameters") or d.get("rope_scaling") or {}
    ):
        raise ModelLoadError(f"{source}: RoPE type {rope_type!r} needs a 'factor' key")
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ModelLoadError(f"{source}: RoPE type 'llama3' needs a {key!r} key")
    factors = d.get("rope_freq_factors")  # written by brisk's GGUF converter only
    if factors is not None:
        head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
        if len(factors) != int(head_dim * partial) // 2:
            raise ModelLoadError(f"{source}: rope_freq_factors has {len(factors)} values; the rotary dimension "
                                 f"{int(head_dim * partial)} needs {int(head_dim * partial) // 2}")
        factors = tuple(float(f) for f in factors)
    return RopeConfig(rope_type=rope_type, theta=theta, factor=factor,
                      partial_rotary_factor=partial, extra=params, freq_factors=factors)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_memory(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory size {text!r} is not understood; write e.g. 2GiB, 512MiB or 3GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


DEFAULT_BLOCK_SIZE = 8


@dataclass(frozen=True)
class CacheConfig:
    # NOTE: 8, not vLLM's 16: prefix sharing works in whole blocks, so a shared prefix wastes
    # up to a block. SmolLM2's chat preamble is 27 tokens: 16 shared at B=16, 24 at B=8; on a
    # burst of 64 chats that is 1418 vs 914 prompt tokens computed (benchmarks/prefill_burst.py).
    # CPU attention gathers K/V per slot, so smaller blocks cost only a little bookkeeping.
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None  # bytes; None = kv_cache_fraction of available memory
    kv_cache_fraction: float = 0.2
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # exact block count (tests, simulations)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not 0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")

    def num_blocks(self, bytes_per_token: int, max_model_len: int, available_bytes: int) -> int:
        """Blocks that fit the budget; raises BriskError if one max_model_len sequence does not."""
        from brisk.errors import BriskError

        if self.num_gpu_blocks_override is not None:
            blocks = self.num_gpu_blocks_override
            budget = blocks * self.block_size * bytes_per_token
        else:
            budget = self.kv_cache_memory or int(available_bytes * self.kv_cache_fraction)
            blocks = budget // (self.block_size * bytes_per_token)
        needed = -(-max_model_len // self.block_size)
        if blocks < needed:
            need_bytes = needed * self.block_size * bytes_per_token
            raise BriskError(
                f"the KV cache ({budget / 2**20:.0f} MiB, {blocks} blocks of {self.block_size} tokens) cannot hold "
                f"one max-length sequence ({max_model_len} tokens needs {need_bytes / 2**20:.0f} MiB); "
                f"raise --kv-cache-memory to at least {-(-need_bytes // 2**20)}MiB or lower --max-model-len"
            )
        return blocks
