"""Every model family brisk runs, each as one record: its Hugging Face and GGUF architecture names, the
switches of the shared decoder block it turns on, what its config class assumes for keys a config.json
leaves out, which of its layers slide by default, the GGUF metadata it spells its own way, and how its GGUF
tensors are named. A new family is one record here plus its tests (tests/test_model_families.py).

Torch-free and I/O-free: `brisk.config` builds a ModelConfig from a record, `brisk.loading.gguf_header`
maps GGUF metadata through it, `brisk.loading.gguf_convert` names tensors by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# A GGUF metadata reader: key(name, default, required) -> the value of `{arch}.{name}`
KeyReader = Callable[..., Any]


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts layer as the family's checkpoints spell it. Every family here routes the same
    way (softmax over the router's logits, the top k kept, renormalised where norm_topk_prob says so);
    transformers' own SparseMoeBlock of each family is the reference."""

    module: str = "mlp"  # the HF module holding the router (`.gate`) and the experts (Mixtral: block_sparse_moe)
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per expert (Mixtral: w1, w3, w2)
    norm_topk_key: str | None = "norm_topk_prob"  # None: the family always renormalises (Mixtral)
    norm_topk_default: bool = False  # the config class's default where config.json leaves the key out
    # llama.cpp's constant for the family's GGUF, which stores no such key (its build_moe_ffn's norm_w)
    gguf_norm_topk: bool = True
    shared_expert: bool = False  # Qwen2-MoE: a dense expert every token takes, times sigmoid(shared_expert_gate)
    sparse_step: bool = False  # decoder_sparse_step and mlp_only_layers pick the MoE layers (Qwen2/3-MoE)
    # gpt-oss: the router (`mlp.router`, with a bias) keeps the top k logits and softmaxes those; every expert
    # projection has a bias; the gate is the clamped SwiGLU (swiglu_limit, swiglu_alpha); transformers stores
    # the experts transposed ([E, in, out]) with gate and up interleaved column by column
    oai: bool = False


@dataclass(frozen=True)
class Family:
    hf_architecture: str
    model_type: str
    gguf_architecture: str | None = None  # general.architecture of its GGUFs (None: not read from GGUF)
    # -- the shared decoder block's switches (all off: Llama's block) --
    qkv_bias: bool = False  # q/k/v projections carry a bias by default (Qwen2)
    # RMSNorm of q and k before RoPE: "head" (one weight of head_dim for every head: Qwen3, Gemma 3) or
    # "full" (over the whole projection, weights of num_heads * head_dim: OLMoE)
    qk_norm: str | None = None
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    gemma: bool = False  # (1 + w) RMSNorm, embeddings times sqrt(hidden), GELU-tanh gate
    experts: Experts | None = None
    nope_layers: bool = False  # some layers apply no RoPE (no_rope_layers; SmolLM3)
    local_rope_key: str | None = None  # the sliding layers' RoPE base (Gemma 3: rope_local_base_freq)
    attention_sinks: bool = False  # a learned logit per head joins every softmax (gpt-oss's `sinks`)
    # -- what its config class assumes for keys config.json leaves out --
    defaults: tuple[tuple[str, Any], ...] = ()
    window_default: int | None = None  # sliding_window when the key is absent (Mistral, Qwen2/3, Gemma 2/3: 4096)
    # which layers slide when config.json lists no layer_types: (config dict, num_layers) -> flags, or None
    sliding_layers: Callable[[dict[str, Any], int], list[bool] | None] | None = None
    # -- GGUF --
    gguf_keys: Callable[[KeyReader, dict[str, Any]], dict[str, Any]] | None = None  # its own keys -> config.json's
    gguf_tensors: str = "plain"  # tensor names: "plain", "sandwich" (Gemma 2/3), "fused" (Phi-3's attn_qkv)
    gguf_permuted: bool = False  # llama.cpp's converter permutes its Q/K rows (interleaved RoPE pairs)
    gguf_sliding_pattern: int | None = None  # every n-th layer is global, the others slide (llama.cpp's constant)


# -- default layer types (transformers' rules for config.json without layer_types) ------------------------------
def _all_slide_unless_null(d: dict[str, Any], num_layers: int) -> list[bool] | None:
    """Mistral: every layer, unless sliding_window is null."""
    return [True] * num_layers if d.get("sliding_window", 4096) is not None else None


def _slide_past_max_window_layers(d: dict[str, Any], num_layers: int) -> list[bool] | None:
    """Qwen2/3 (and their MoE): the layers from max_window_layers on, when use_sliding_window is true."""
    if not d.get("use_sliding_window", False):
        return None
    first = int(d.get("max_window_layers", 28))
    return [i >= first for i in range(num_layers)]


def _every_other(d: dict[str, Any], num_layers: int) -> list[bool]:
    """Gemma 2: every other layer, from the first."""
    return [(i + 1) % 2 == 1 for i in range(num_layers)]


def _gemma3_pattern(d: dict[str, Any], num_layers: int) -> list[bool]:
    """Gemma 3: five of every sliding_window_pattern (6) layers."""
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    return [(i + 1) % pattern != 0 for i in range(num_layers)]


def _when_window_set(d: dict[str, Any], num_layers: int) -> list[bool] | None:
    """Llama with a window, Phi-3, Mixtral: every layer when sliding_window is set."""
    return [True] * num_layers if d.get("sliding_window") is not None else None


SMOLLM3_NOPE_INTERVAL = 4  # llama.cpp's constant: SmolLM3 leaves out RoPE every 4th layer


def nope_flags(d: dict[str, Any], num_layers: int) -> list[int] | None:
    """SmolLM3: `no_rope_layers[i]` is 1 where layer i applies RoPE (every 4th does not, by default)."""
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval", SMOLLM3_NOPE_INTERVAL))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    return flags


def _smollm3_windows(d: dict[str, Any], num_layers: int) -> list[bool] | None:
    """SmolLM3: its NoPE layers slide, when use_sliding_window is true."""
    if not (d.get("use_sliding_window") and d.get("sliding_window") is not None):
        return None
    flags = nope_flags(d, num_layers)
    return [not flags[i] if isinstance(flags, list) and i < len(flags) else False for i in range(num_layers)]


# -- GGUF keys a family spells its own way ----------------------------------------------------------------------
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's constant for Gemma 3's sliding layers


def _gemma_keys(arch: str) -> Callable[[KeyReader, dict[str, Any]], dict[str, Any]]:
    def keys(key: KeyReader, config: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {"norm_weight_offset": 0.0}  # llama.cpp's converter stores the norms as 1 + w
        if config["num_hidden_layers"] == _GEMMA_27B_LAYERS.get(arch):  # the 27Bs scale queries by hidden/heads
            extra["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
        else:
            extra["query_pre_attn_scalar"] = config["head_dim"]
        extra["attn_logit_softcapping"] = key("attn_logit_softcapping", None, required=False)
        extra["final_logit_softcapping"] = key("final_logit_softcapping", None, required=False)
        if arch == "gemma3":
            extra["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_BASE
        return extra
    return keys


def _smollm3_keys(key: KeyReader, config: dict[str, Any]) -> dict[str, Any]:
    return {"no_rope_layer_interval": SMOLLM3_NOPE_INTERVAL}


def _phi3_keys(key: KeyReader, config: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    original = key("rope.scaling.original_context_length", None, required=False)
    if original:
        extra["original_max_position_embeddings"] = int(original)
    attn_factor = key("rope.scaling.attn_factor", None, required=False)
    if attn_factor is not None:
        extra["brisk_rope_attention_factor"] = float(attn_factor)
    return extra


GPT_OSS_SWIGLU = (1.702, 7.0)  # llama.cpp's constants for gpt-oss's clamped SwiGLU (alpha, limit): its GGUF stores none


def _gpt_oss_keys(key: KeyReader, config: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: biases on the attention, and the clamped SwiGLU's constants (llama.cpp's: its GGUF stores none).
    YaRN comes from the generic rope.scaling keys and truncates its ramp as llama.cpp does (HF's gpt-oss config
    says truncate false: the two differ by a few frequencies' ramp; a GGUF runs as llama.cpp runs it)."""
    return {"attention_bias": True, "swiglu_alpha": GPT_OSS_SWIGLU[0], "swiglu_limit": GPT_OSS_SWIGLU[1]}


def expert_keys(family: "Family", key: KeyReader, config: dict[str, Any]) -> dict[str, Any]:
    """An MoE family's GGUF expert metadata as its config.json spells it."""
    experts = family.experts
    out = {"num_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
           "moe_intermediate_size": int(key("expert_feed_forward_length", config["intermediate_size"])),
           "norm_topk_prob": experts.gguf_norm_topk}
    if experts.shared_expert:
        out["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
    return out


# -- the records ---------------------------------------------------------------------------------------------
_QWEN_MOE_EXPERTS = dict(sparse_step=True)
RECORDS = (
    Family("LlamaForCausalLM", "llama", "llama", sliding_layers=_when_window_set, gguf_permuted=True),
    Family("MistralForCausalLM", "mistral", None, window_default=4096, sliding_layers=_all_slide_unless_null),
    Family("Qwen2ForCausalLM", "qwen2", "qwen2", qkv_bias=True, window_default=4096,
           sliding_layers=_slide_past_max_window_layers),
    Family("Qwen3ForCausalLM", "qwen3", "qwen3", qk_norm="head", window_default=4096,
           sliding_layers=_slide_past_max_window_layers),
    Family("GemmaForCausalLM", "gemma", "gemma", gemma=True, gguf_keys=_gemma_keys("gemma")),
    Family("Gemma2ForCausalLM", "gemma2", "gemma2", sandwich_norms=True, gemma=True, defaults=(
        ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("query_pre_attn_scalar", 256)),
        window_default=4096, sliding_layers=_every_other, gguf_keys=_gemma_keys("gemma2"), gguf_tensors="sandwich",
        gguf_sliding_pattern=2),
    Family("Gemma3ForCausalLM", "gemma3_text", "gemma3", qk_norm="head", sandwich_norms=True, gemma=True, defaults=(
        ("query_pre_attn_scalar", 256), ("rope_theta", 1_000_000.0)), window_default=4096,
        sliding_layers=_gemma3_pattern, local_rope_key="rope_local_base_freq", gguf_keys=_gemma_keys("gemma3"),
        gguf_tensors="sandwich", gguf_sliding_pattern=6),
    Family("Phi3ForCausalLM", "phi3", "phi3", sliding_layers=_when_window_set, gguf_keys=_phi3_keys,
           gguf_tensors="fused"),
    Family("SmolLM3ForCausalLM", "smollm3", "smollm3", nope_layers=True, sliding_layers=_smollm3_windows,
           gguf_keys=_smollm3_keys, gguf_permuted=True),
    # -- mixtures of experts --
    Family("MixtralForCausalLM", "mixtral", "llama", sliding_layers=_when_window_set, gguf_permuted=True,
           experts=Experts(module="block_sparse_moe", projections=("w1", "w3", "w2"), norm_topk_key=None,
                           norm_topk_default=True, gguf_norm_topk=True)),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", qk_norm="head", window_default=4096,
           sliding_layers=_slide_past_max_window_layers,
           experts=Experts(gguf_norm_topk=True, **_QWEN_MOE_EXPERTS)),
    Family("Qwen2MoeForCausalLM", "qwen2_moe", "qwen2moe", qkv_bias=True, window_default=4096,
           sliding_layers=_slide_past_max_window_layers,
           experts=Experts(gguf_norm_topk=False, shared_expert=True, **_QWEN_MOE_EXPERTS)),
    Family("OlmoeForCausalLM", "olmoe", "olmoe", qk_norm="full", experts=Experts(gguf_norm_topk=False)),
    Family("GptOssForCausalLM", "gpt_oss", "gpt-oss", attention_sinks=True, sliding_layers=_every_other,
           defaults=(("attention_bias", True), ("sliding_window", 128), ("swiglu_alpha", GPT_OSS_SWIGLU[0]),
                     ("swiglu_limit", GPT_OSS_SWIGLU[1]), ("rms_norm_eps", 1e-5), ("rope_theta", 150000.0),
                     ("rope_scaling", {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 4096})),
           gguf_keys=_gpt_oss_keys, gguf_tensors="oai", gguf_sliding_pattern=2,
           experts=Experts(module="mlp", norm_topk_key=None, norm_topk_default=True, gguf_norm_topk=True, oai=True)),
)

FAMILIES: dict[str, Family] = {f.hf_architecture: f for f in RECORDS}
BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in RECORDS}

# Mixture-of-experts variants brisk cannot run, named so that their refusal says what they are
UNSUPPORTED = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2's multi-head latent attention (MLA)",
    "DeepseekV3ForCausalLM": "DeepSeek-V3's multi-head latent attention (MLA) and grouped sigmoid routing",
    "deepseek2": "DeepSeek-V2/V3's multi-head latent attention (MLA)",
    "Glm4MoeForCausalLM": "GLM-4.5's sigmoid routing with expert groups", "glm4moe": "GLM-4.5's sigmoid routing",
    "Qwen3NextForCausalLM": "Qwen3-Next's linear attention", "qwen3next": "Qwen3-Next's linear attention",
    "PhimoeForCausalLM": "Phi-MoE's sparsemixer routing", "JambaForCausalLM": "Jamba's Mamba layers",
    "DbrxForCausalLM": "DBRX's fused expert layout", "dbrx": "DBRX's fused expert layout",
    "GraniteMoeForCausalLM": "Granite-MoE's scaled multipliers", "granitemoe": "Granite-MoE's scaled multipliers",
}


def family_of_architecture(name: str) -> Family | None:
    """A config.json architecture's family: `XForCausalLM`, or its base model `XModel` (embedding checkpoints such as
    Qwen3-Embedding save the base model: no LM head)."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name.endswith("Model"):
        return FAMILIES.get(name.removesuffix("Model") + "ForCausalLM")
    return None


def gguf_family(arch: str | None, expert_count: int) -> Family | None:
    """The family of a GGUF by its general.architecture (and whether it has experts: Mixtral's GGUFs say
    "llama"), or None."""
    for family in RECORDS:
        if family.gguf_architecture == arch and (family.experts is not None) == (expert_count > 0):
            return family
    return None


def gguf_architectures() -> list[str]:
    return sorted({f.gguf_architecture for f in RECORDS if f.gguf_architecture})
