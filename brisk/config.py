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
from brisk.families import BY_MODEL_TYPE, FAMILIES, UNSUPPORTED, Family, family_of_architecture, nope_flags
from brisk.kv_dtype import ALIASES as KV_ALIASES, CHOICES as KV_CHOICES, KVDtype

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# transformers' activation names -> the gate brisk computes
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu": "gelu"}

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# --quantization: auto (a GGUF keeps its quantized types; float checkpoints stay float), none
# (everything float), int8 / int4 (every weight matrix quantized in blocks of 32 at load)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "bf16", "f16")

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts' layers: each token's router logits [num_experts] go through a softmax, the top
    `experts_per_token` are kept (renormalised to sum 1 where `norm_topk_prob`), and the token's MLP output
    is the weighted sum of those experts' SwiGLU outputs (+ a shared expert's, times the sigmoid of its own
    gate, where `shared_expert_intermediate_size`)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]  # the layers whose MLP is the expert layer (the others are dense)
    shared_expert_intermediate_size: int | None = None
    # gpt-oss (Experts.oai): the router's top k logits softmaxed (not a softmax's top k), biases on the router
    # and on every expert projection, and the clamped SwiGLU: gate clamped above at swiglu_limit, up clamped to
    # +-swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    oai: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


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
    # -- what families change (Family; all off for Llama) --
    hidden_act: str = "silu"  # the MLP's gate: silu, gelu_tanh or gelu
    qk_norm: str | None = None  # "head": one [head_dim] weight for every head (Qwen3); "full": over the projection (OLMoE)
    sandwich_norms: bool = False
    norm_weight_offset: float = 0.0  # added to every RMSNorm weight at load: Gemma's (1 + w) as stored by HF
    embed_scale: float | None = None  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma 2/3); else head_dim's
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    sliding_rope: RopeConfig | None = None  # RoPE of the sliding-window layers, when it differs (Gemma 3)
    nope_layers: tuple[int, ...] = ()  # layers that apply no RoPE at all (SmolLM3)
    moe: MoeConfig | None = None  # the expert layers of a mixture of experts (None: every MLP is dense)
    o_bias: bool = False  # the attention's output projection has a bias (attention_bias: Llama's and gpt-oss's)
    attention_sinks: bool = False  # a learned logit per head joins each softmax, attending to nothing (gpt-oss)

    @property
    def kv_window(self) -> int | None:
        """W when every layer is windowed (K/V older than the window is never read again and its
        blocks can be freed); None when any layer attends to the whole context."""
        if self.layer_windows and all(w is not None for w in self.layer_windows):
            return max(self.layer_windows)
        return None

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def stack_compiles(self) -> bool:
        """Llama's block, with q/k norms, biases, attention sinks and routed experts (gpt-oss's too) allowed
        (what brisk's compiled decode stack runs): the other families' extras off, and no shared expert."""
        return (self.hidden_act == "silu" and not self.sandwich_norms and self.attn_softcap is None
                and self.sliding_rope is None and not self.nope_layers
                and (self.moe is None or not self.moe.shared_expert_intermediate_size))

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters of the weight matrices, embeddings and norms: a mixture of
        experts reads only its k routed experts' weights per token (the load report names both)."""
        h, layers = self.hidden_size, self.num_layers
        attn = (h * (self.q_size + 2 * self.kv_size) + self.q_size * h + (self.q_size + 2 * self.kv_size) * self.qkv_bias
                + h * self.o_bias + self.num_heads * self.attention_sinks)
        dense_mlp = 3 * h * self.intermediate_size
        total = active = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(layers):
            norms = 2 * h * (2 if self.sandwich_norms else 1)
            total, active = total + attn + norms, active + attn + norms
            if not self.is_moe_layer(i):
                total, active = total + dense_mlp, active + dense_mlp
                continue
            moe = self.moe
            expert = 3 * h * moe.expert_intermediate_size
            shared = (3 * h * moe.shared_expert_intermediate_size + h) if moe.shared_expert_intermediate_size else 0
            total += h * moe.num_experts + moe.num_experts * expert + shared
            active += h * moe.num_experts + moe.experts_per_token * expert + shared
        return total, active

    def rope_of_layer(self, layer: int) -> RopeConfig | None:
        """The RoPE layer `layer` applies, or None (a NoPE layer)."""
        if layer in self.nope_layers:
            return None
        if self.sliding_rope is not None and self.layer_windows and self.layer_windows[layer] is not None:
            return self.sliding_rope
        return self.rope

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype: KVDtype) -> int:
        """Bytes of K and V one token occupies across all layers, in the KV cache's element type
        (int8's scales included)."""
        return 2 * self.num_layers * self.num_kv_heads * kv_dtype.row_bytes(self.head_dim)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        family = _family(d, source)
        arch = family.hf_architecture
        d = {**dict(family.defaults), **d}
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ModelLoadError(
                f"{source}: missing required key(s) {', '.join(missing)}; "
                "the file is incomplete — re-export the model's config.json"
            )
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = int(d.get("head_dim") or hidden // num_heads)
        num_layers = int(d["num_hidden_layers"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qkv_bias = True if family.qkv_bias else bool(d.get("attention_bias", False))
        windows = _windows_from_hf(d, family, num_layers, source)
        rope, sliding_rope = _ropes_from_hf(d, family, source)
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family.gemma)),
            qkv_bias=qkv_bias,
            rope=rope,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_windows=windows,
            hidden_act=_activation(d, family, source),
            qk_norm=family.qk_norm,
            moe=_moe_from_hf(d, family, num_layers, source),
            sandwich_norms=family.sandwich_norms,
            # brisk's GGUF conversion writes 0: llama.cpp's converter stores Gemma norms as 1 + w already
            norm_weight_offset=float(d.get("norm_weight_offset", 1.0 if family.gemma else 0.0)),
            embed_scale=hidden ** 0.5 if family.gemma else None,
            query_pre_attn_scalar=_optional_float(d.get("query_pre_attn_scalar")) if family.gemma else None,
            attn_softcap=_optional_float(d.get("attn_logit_softcapping")),
            final_softcap=_optional_float(d.get("final_logit_softcapping")),
            sliding_rope=sliding_rope if windows and any(w is not None for w in windows) else None,
            nope_layers=_nope_layers(d, family, num_layers, source),
            o_bias=bool(d.get("attention_bias", False)),
            attention_sinks=family.attention_sinks,
        )


def _family(d: dict[str, Any], source: str) -> Family:
    """The family record of a config.json, or one clear error naming what it is and what brisk runs."""
    archs = d.get("architectures") or []
    found = next((f for f in map(family_of_architecture, archs) if f), None) if archs else \
        BY_MODEL_TYPE.get(d.get("model_type"))
    if found is not None:
        return found
    named = next((a for a in archs if a in UNSUPPORTED), None)
    if named is not None:
        raise ModelLoadError(f"{source}: {named} is a model brisk cannot run ({UNSUPPORTED[named]} is not "
                             f"implemented); brisk runs {', '.join(sorted(FAMILIES))}")
    raise ModelLoadError(f"{source}: unsupported architecture {archs or d.get('model_type')!r}; "
                         f"brisk runs {', '.join(sorted(FAMILIES))}")


def _positive_int(d: dict[str, Any], keys: tuple[str, ...], source: str, default: Any = None) -> int:
    value = next((d[k] for k in keys if d.get(k) is not None), default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(f"{source}: {keys[0]} must be a positive integer, got {value!r}")
    return value


def _moe_from_hf(d: dict[str, Any], family: Family, num_layers: int, source: str) -> MoeConfig | None:
    """A mixture-of-experts family's expert layers, read as transformers' config class reads them."""
    spec = family.experts
    if spec is None:
        return None
    for key, what in (("scoring_func", "softmax"), ("router_activation", "softmax")):
        if d.get(key) not in (None, what):
            raise ModelLoadError(f"{source}: {key} {d[key]!r} is a gating function brisk does not run "
                                 f"(it routes with {what} then top-k)")
    if d.get("clip_qkv") is not None:
        raise ModelLoadError(f"{source}: clip_qkv {d['clip_qkv']!r} (q/k/v clamping) is not implemented; brisk "
                             "runs OLMoE checkpoints without it (clip_qkv null)")
    num_experts = _positive_int(d, ("num_experts", "num_local_experts"), source)
    per_token = _positive_int(d, ("num_experts_per_tok",), source)
    if per_token > num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok {per_token} exceeds the {num_experts} experts")
    # transformers (Qwen2/3-MoE): MoE where not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; brisk's
    # GGUF conversion lists a GGUF's layers without a router in mlp_only_layers, whatever the family
    step = _positive_int(d, ("decoder_sparse_step",), source, 1) if spec.sparse_step else 1
    dense = set(d.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    norm = bool(d.get(spec.norm_topk_key, spec.norm_topk_default)) if spec.norm_topk_key else spec.norm_topk_default
    shared = None
    if spec.shared_expert:
        shared = _positive_int(d, ("shared_expert_intermediate_size",), source)
    size_keys = ("moe_intermediate_size", "intermediate_size") if family.model_type != "mixtral" else ("intermediate_size",)
    oai = {}
    if spec.oai:
        oai = dict(oai=True, swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), swiglu_limit=float(d.get("swiglu_limit", 7.0)))
    return MoeConfig(num_experts, per_token, _positive_int(d, size_keys, source), norm, layers, shared, **oai)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _activation(d: dict[str, Any], family: Family, source: str) -> str:
    # Gemma's config keeps `hidden_act: gelu` for the original checkpoints while transformers runs
    # `hidden_activation` (gelu_pytorch_tanh by default), as the reference implementation does
    name = (d.get("hidden_activation") or "gelu_pytorch_tanh") if family.gemma else (d.get("hidden_act") or "silu")
    if name not in ACTIVATIONS:
        raise ModelLoadError(f"{source}: activation {name!r} is not supported; brisk runs "
                             f"{', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def _nope_layers(d: dict[str, Any], family: Family, num_layers: int, source: str) -> tuple[int, ...]:
    """SmolLM3: `no_rope_layers[i]` is 1 where layer i applies RoPE (every 4th layer does not, by default)."""
    if not family.nope_layers:
        return ()
    flags = nope_flags(d, num_layers)
    if not isinstance(flags, list) or len(flags) != num_layers:
        raise ModelLoadError(f"{source}: no_rope_layers must list one 0/1 flag per layer ({num_layers}), got {flags!r}")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def _windows_from_hf(d: dict[str, Any], family: Family, num_layers: int, source: str) -> tuple[int | None, ...]:
    """Per-layer sliding windows with transformers' semantics: an explicit `layer_types` list wins,
    else the family's default layer types (`_default_layer_types`)."""
    types = d.get("layer_types")
    if types is None:
        types = _default_layer_types(d, family, num_layers)
        if types is None:
            return ()
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelLoadError(f"{source}: layer_types must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        raise ModelLoadError(f"{source}: layer_types {', '.join(map(str, unknown))} are not supported; brisk runs "
                             "full_attention and sliding_attention layers")
    if "sliding_attention" not in types:
        return ()
    # some families' config classes default the window (4096) when the key is absent
    window = d.get("sliding_window", family.window_default)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"{source}: sliding_window must be a positive integer for sliding_attention layers, "
                             f"got {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _default_layer_types(d: dict[str, Any], family: Family, num_layers: int) -> list[str] | None:
    """transformers' layer types when config.json lists none (None: no layer is windowed): the family's rule
    (brisk.families: Mistral windows every layer unless sliding_window is null, Qwen2/3 the layers from
    max_window_layers on when use_sliding_window is true, Gemma 2 every other layer, Gemma 3 five of every
    six, SmolLM3 its NoPE layers when use_sliding_window is true, Llama and Phi-3 every layer when
    sliding_window is set)."""
    sliding = family.sliding_layers(d, num_layers) if family.sliding_layers else None
    if sliding is None:
        return None
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _ropes_from_hf(d: dict[str, Any], family: Family, source: str) -> tuple[RopeConfig, RopeConfig | None]:
    """The model's RoPE, and the sliding layers' own where it differs (Gemma 3: `rope_local_base_freq`,
    or transformers 5's `rope_parameters` keyed by layer type)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full = _rope_from_hf({**d, "rope_parameters": params["full_attention"]}, source)
        local = params.get("sliding_attention")
        return full, (_rope_from_hf({**d, "rope_parameters": local}, source) if isinstance(local, dict) else None)
    rope = _rope_from_hf(d, source)
    if family.local_rope_key:
        local = RopeConfig(theta=float(d.get(family.local_rope_key, 10000.0)),
                           partial_rotary_factor=rope.partial_rotary_factor)
        return rope, local
    return rope, None


def _rope_from_hf(d: dict[str, Any], source: str) -> RopeConfig:
    """Read RoPE settings from either HF v5 `rope_parameters` or older `rope_scaling`."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "su":  # Phi-3's first name for longrope (transformers maps it so)
        rope_type = "longrope"
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
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          d.get("original_max_position_embeddings") or d.get("max_position_embeddings"))
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(params.get(key), list):
                raise ModelLoadError(f"{source}: RoPE type 'longrope' needs a {key!r} list")
        if "factor" not in (d.get("rope_parameters") or d.get("rope_scaling") or {}):
            # transformers: the ratio of the context to the pretrained one sets the attention factor
            factor = float(d.get("max_position_embeddings", 2048)) / float(params["original_max_position_embeddings"])
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


def host_available_memory() -> int:
    """The host's MemAvailable in bytes (torch-free: `brisk serve`'s pre-flight checks use it)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
    kv_cache_dtype: str = "auto"  # brisk/kv_dtype.py: auto, float32, bfloat16, float16, fp8(_e4m3/_e5m2), int8
    kv_cache_dir: str | None = None  # the disk tier's folder (brisk/engine/kv_cache/disk_tier.py); None: no disk tier
    kv_cache_disk_bytes: int = 16 * 2**30  # the disk tier's budget in that folder
    kv_cache_host_bytes: int = 0  # the host tier's budget (brisk/engine/kv_cache/host_tier.py); 0: no host tier

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not 0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")
        if self.kv_cache_dtype not in KV_CHOICES and self.kv_cache_dtype not in KV_ALIASES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: use one of {', '.join(KV_CHOICES)}")

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
