"""Get a model ready to run: resolve the source, convert a GGUF once, memory-map the
weights into a module built on the `meta` device, load the tokenizer, and run a
first forward — timing each phase in a `LoadReport`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from brisk import kernels
from brisk.config import QUANTIZATION_CHOICES, ModelConfig
from brisk.families import FAMILIES
from brisk.errors import BriskError, ModelLoadError
from brisk.kernels.paths import compute_paths
from brisk.kv_dtype import KVDtype, resolve as resolve_kv_dtype
from brisk.loading import gguf_convert, memory_plan, mxfp4, safetensors_io
from brisk.cache_dir import cache_dir
from brisk.loading.pooling import Pooling, pooling_of
from brisk.loading.report import LoadReport
from brisk.models import moe, quant
from brisk.models.linear import Linear
from brisk.models.decoder import DecoderForCausalLM
from brisk.models.registry import ModelSource, resolve
from brisk.models.simple_cache import SingleSequenceCache
from brisk.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    report: LoadReport
    name: str
    # Memory maps backing the zero-copy weights; they must outlive the model.
    mapped_files: list[Any] = field(default_factory=list, repr=False)
    # an embedding model's pooling (brisk.loading.pooling): it serves /v1/embeddings, not generation
    pooling: Pooling | None = None
    # a GGUF's first start with `convert_in_memory`: served from the converted image while the cache is written
    # behind (brisk.loading.conversion_image.ConvertedImage; the server starts its writer once ready)
    conversion: Any = None


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BriskError(f"--device {device!r} is not a device; use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BriskError(f"--device {device} requested but no CUDA device is available; use --device cpu")
    return dev


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in _DTYPES:
        raise BriskError(f"--dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def _auto_weights(source: ModelSource, model_dir: Path, dtype: str | None, device: torch.device) -> str:
    """What `--quantization auto` keeps a checkpoint's weights in. A checkpoint whose linear weights
    are all bfloat16 (most Hub checkpoints; a GGUF made with `--outtype bf16`), or all float16, keeps
    them so on a CPU with brisk's 16-bit kernel (half_matmul.cpp: AVX2 or AVX-512; activations stay
    float32, so results match the float32 model on the same weights): half the bytes of float32,
    and a decode step reads half as much. An explicit --dtype, another device, or a checkpoint with
    float32 or quantized weights: "auto", as before (a GGUF keeps its quantized types).
    A GGUF is judged by its converted checkpoint (a JSON header: nothing added to a warm start), or
    before its first conversion by its own header, which predicts the same types."""
    if dtype not in (None, "auto") or device.type != "cpu":
        return "auto"
    if source.kind == "gguf" and not (model_dir / "config.json").exists():
        found = gguf_convert.linear_types(source.path)
    else:
        found = set()
        for file in safetensors_io.checkpoint_files(model_dir):
            header, _ = safetensors_io.read_header(file)
            found |= {info["dtype"] for name, info in header.items()
                      if name.endswith("_proj.weight") or name.rpartition(".")[2] in quant.QUANT_SUFFIXES}
    method = {frozenset({"BF16"}): "bf16", frozenset({"F16"}): "f16"}.get(frozenset(found), "auto")
    if method != "auto" and compute_paths(device).kernel_level < 2:
        return "auto"  # the portable loop is slower than float32 oneDNN: keep the old behaviour
    return method


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON ({e}); re-download it") from None


def _eos_ids(model_dir: Path, cfg: ModelConfig) -> tuple[int, ...]:
    gen_path = model_dir / "generation_config.json"
    ids = list(cfg.eos_token_ids)
    if gen_path.is_file():
        eos = _read_json(gen_path).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return tuple(dict.fromkeys(ids))


def _fuse(tensors: dict[str, torch.Tensor], fused: str, parts: list[str]) -> None:
    """Replace `parts` by their concatenation (the one deliberate copy of an HF-layout load)."""
    if fused in tensors or not all(p in tensors for p in parts):
        return
    tensors[fused] = torch.cat([tensors.pop(p) for p in parts], dim=0)


def model_state(shards: list[dict[str, torch.Tensor]], cfg: ModelConfig, head: bool = True) -> dict[str, torch.Tensor]:
    """Checkpoint tensors renamed and fused into this model's parameter names (`head` False: an embedding model's,
    which has no LM head; a base-model checkpoint's names, without `model.`, as the model's)."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(shard)
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]
    if "model.embed_tokens.weight" not in tensors and "embed_tokens.weight" in tensors:  # Qwen3Model (embeddings)
        tensors = {f"model.{n}": t for n, t in tensors.items()}
    if not head:  # an embedding model pools hidden states: a head in its file (any format) is never read
        for name in [n for n in tensors if n.startswith("lm_head.")]:
            del tensors[name]
    elif cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            _fuse(tensors, f"{attn}qkv_proj.{kind}", [f"{attn}{p}_proj.{kind}" for p in "qkv"])
        if cfg.is_moe_layer(i):
            _stack_experts(tensors, i, cfg)
            mlp += "shared_expert."
        _fuse(tensors, f"{mlp}gate_up_proj.weight", [f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"])
    if cfg.norm_weight_offset:  # Gemma's RMSNorm scales by (1 + w): folded in once, in float32 as HF computes it
        for name in [n for n in tensors if n.endswith("norm.weight")]:
            tensors[name] = tensors[name].float() + cfg.norm_weight_offset
    return tensors


def _stack_experts(tensors: dict[str, torch.Tensor], layer: int, cfg: ModelConfig) -> None:
    """A layer's experts as the model holds them: `mlp.experts.gate_up_proj.weight` [E, 2 * I, H] (each expert's
    gate rows, then its up rows) and `mlp.experts.down_proj.weight` [E, H, I], from the Hub's one tensor per
    expert and projection (Mixtral's w1/w3/w2 under block_sparse_moe), or from transformers 5's stacked ones;
    the router becomes `mlp.gate.weight`."""
    spec = FAMILIES[cfg.architecture].experts
    src, dst = f"model.layers.{layer}.{spec.module}.", f"model.layers.{layer}.mlp."
    if spec.oai:
        _oai_experts(tensors, dst)
        return
    if src != dst and f"{src}gate.weight" in tensors:
        tensors[f"{dst}gate.weight"] = tensors.pop(f"{src}gate.weight")
    for name in ("gate_up_proj", "down_proj"):  # transformers 5's own layout: stacked already
        if f"{dst}experts.{name}" in tensors:
            tensors[f"{dst}experts.{name}.weight"] = tensors.pop(f"{dst}experts.{name}")
    gate, up, down = spec.projections
    per_expert = [f"{src}experts.{e}." for e in range(cfg.moe.num_experts)]
    if f"{per_expert[0]}{gate}.weight" not in tensors:
        return  # stacked already, or missing (the load names what is missing)
    try:
        stacked = {"gate_up_proj": [torch.cat([tensors.pop(f"{e}{gate}.weight"), tensors.pop(f"{e}{up}.weight")])
                                    for e in per_expert],
                   "down_proj": [tensors.pop(f"{e}{down}.weight") for e in per_expert]}
    except KeyError as e:
        raise ModelLoadError(f"checkpoint lacks expert tensor {e.args[0]} of layer {layer} ({cfg.moe.num_experts} "
                             "experts in config.json)") from None
    for name, weights in stacked.items():
        tensors[f"{dst}experts.{name}.weight"] = torch.stack(weights)


HARMONY_STOPS = ("<|return|>", "<|call|>")  # gpt-oss's stop tokens (its generation_config's, llama.cpp's EOG)


def _gate_then_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's interleaved gate/up (gate at even indices of `dim`, up at odd) -> gate's, then up's."""
    index = [slice(None)] * t.dim()
    index[dim] = slice(0, None, 2)
    gate = t[tuple(index)]
    index[dim] = slice(1, None, 2)
    return torch.cat([gate, t[tuple(index)]], dim=dim)


def _oai_experts(tensors: dict[str, torch.Tensor], mlp: str) -> None:
    """gpt-oss's layer as transformers stores it -> brisk's names: the router `mlp.router` -> `mlp.gate`; the
    experts, stored [E, in, out] with gate and up interleaved column by column, -> [E, out, in] with gate's rows
    then up's (their biases likewise); MXFP4 `*_blocks`/`*_scales` (the Hub's checkpoints, already [E, out, ...],
    rows interleaved) -> brisk's MXFP4 tiles (brisk.loading.mxfp4)."""
    for kind in ("weight", "bias"):
        if f"{mlp}router.{kind}" in tensors:
            tensors[f"{mlp}gate.{kind}"] = tensors.pop(f"{mlp}router.{kind}")
    experts = f"{mlp}experts."
    if f"{experts}gate_proj_bias" in tensors and f"{experts}up_proj_bias" in tensors:  # from a GGUF: apart
        tensors[f"{experts}gate_up_proj_bias"] = torch.cat([tensors.pop(f"{experts}gate_proj_bias"),
                                                            tensors.pop(f"{experts}up_proj_bias")], dim=-1)
    elif f"{experts}gate_up_proj_bias" in tensors:
        tensors[f"{experts}gate_up_proj_bias"] = _gate_then_up(tensors[f"{experts}gate_up_proj_bias"], -1)
    if f"{experts}gate_up_proj" in tensors:
        tensors[f"{experts}gate_up_proj.weight"] = _gate_then_up(tensors.pop(f"{experts}gate_up_proj").transpose(1, 2), 1)
    if f"{experts}down_proj" in tensors:
        tensors[f"{experts}down_proj.weight"] = tensors.pop(f"{experts}down_proj").transpose(1, 2)
    for name in ("gate_up_proj", "down_proj"):
        if f"{experts}{name}_blocks" in tensors:
            blocks, scales = tensors.pop(f"{experts}{name}_blocks"), tensors.pop(f"{experts}{name}_scales")
            if name == "gate_up_proj":
                blocks, scales = _gate_then_up(blocks, 1), _gate_then_up(scales, 1)
            tensors.update({f"{experts}{name}.{k}": t for k, t in mxfp4.from_hub(blocks, scales).items()})


def _format_of(tensors: dict[str, torch.Tensor], qweight: str) -> str:
    base = qweight.removesuffix(".qweight")
    fmt = (moe.expert_format if ".experts." in base else quant.QuantFormat.of)(tensors, base)
    return fmt.name if fmt is not None else "quantized"


def _expected_names(model: DecoderForCausalLM) -> set[str]:
    names = set(model.state_dict().keys())
    if model.config.tie_word_embeddings:  # the head reads the embedding's tensors
        names = {n for n in names if not n.startswith("lm_head.")}
    return names


def _is_quantized(name: str) -> bool:
    return name.rpartition(".")[2] in (*quant.QUANT_SUFFIXES, quant.CODEBOOK)


def _place(tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
           prefetcher: safetensors_io.ShardPrefetcher) -> dict[str, torch.Tensor]:
    """Cast/move weights. On CPU with a matching dtype this is free (views stay on the mmap);
    quantized blocks are used as stored."""
    if device.type == "cuda":
        prefetcher.wait_all()
        return _to_cuda(tensors, device, dtype)
    return {n: t if t.dtype == dtype or _is_quantized(n) else t.to(dtype) for n, t in tensors.items()}


def _quantize_at_load(tensors: dict[str, torch.Tensor], method: str,
                      maps: list[safetensors_io.MappedFile] = ()) -> None:
    """--quantization int8/int4/bf16/f16 on a float checkpoint: every linear weight (and the LM
    head; for bf16/f16 the embeddings too) becomes quantized blocks or 16-bit floats; the float
    originals are dropped (a mapped original gives its pages back once a new copy replaces it)."""
    for name in [n for n in tensors if quant.converts(n, method)]:
        shape = tuple(tensors[name].shape)
        quant.check_quantizable(name, shape[-2:] if len(shape) == 3 else shape, method)  # 3-D: stacked experts
        base = name.removesuffix(".weight")
        original = tensors.pop(name)
        blocks = _quantized_blocks(name, original, method)
        if blocks["qweight"].data_ptr() != original.data_ptr():
            any(m.release(original) for m in maps)
        for suffix, t in blocks.items():
            tensors[f"{base}.{suffix}"] = t


def _quantized_blocks(name: str, weight: torch.Tensor, method: str) -> dict[str, torch.Tensor]:
    """A float weight [N, K] (or stacked experts [E, N, K], each expert by itself) in `method`'s format, tiled
    where its rows fill tiles."""
    if weight.dim() == 3:
        experts = [_quantized_blocks(name, w, method) for w in weight]
        return {k: experts[0][k] if k == quant.CODEBOOK else torch.stack([e[k] for e in experts]) for k in experts[0]}
    blocks = quant.QUANTIZERS[method](weight)
    if quant.tileable(name, quant.method_format(method), blocks["qweight"].shape[0]):
        blocks = quant.tile(blocks)
    return blocks


def _dequantize_all(tensors: dict[str, torch.Tensor]) -> None:
    """Quantized weights -> float ones (a stacked projection's parts, `name.parts.{i}`, into one `name.weight`)."""
    for base in sorted(n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")):
        stacked = ".experts." in base  # stacked experts: each expert by itself
        bits = (moe.expert_format if stacked else quant.QuantFormat.of)(tensors, base).kernel_bits
        qweight, scales, mins, subscales = (tensors.pop(f"{base}.{s}", None) for s in quant.QUANT_SUFFIXES)
        tensors.pop(f"{base}.{quant.CODEBOOK}", None)
        if stacked:
            tensors[f"{base}.weight"] = torch.stack([kernels.dequantize(
                qweight[e], scales[e] if scales is not None else None, None if mins is None else mins[e], bits,
                subscales=None if subscales is None else subscales[e]) for e in range(qweight.shape[0])])
        else:
            tensors[f"{base}.weight"] = kernels.dequantize(qweight, scales, mins, bits, subscales=subscales)
    for name in sorted(n for n in tensors if n.endswith(f"{quant.PARTS}0.weight")):
        stacked = name.removesuffix(f"{quant.PARTS}0.weight")
        parts = []
        while f"{stacked}{quant.PARTS}{len(parts)}.weight" in tensors:
            parts.append(tensors.pop(f"{stacked}{quant.PARTS}{len(parts)}.weight"))
        tensors[f"{stacked}.weight"] = torch.cat(parts, dim=1 if ".experts." in stacked else 0)  # experts: [E, N, K]


def _check_memory(source: Path, model_dir: Path, quantization: str, max_model_len: int | None,
                  device: torch.device, dtype: torch.dtype, kv: KVDtype) -> None:
    """Refuse a model that cannot fit before reading (or converting) any weight."""

    if (model_dir / "config.json").exists():
        cfg = ModelConfig.from_hf_dict(_read_json(model_dir / "config.json"), str(model_dir / "config.json"))
        weights = memory_plan.checkpoint_weight_bytes(model_dir, quantization, dtype.itemsize)
        per_token, window = cfg.kv_bytes_per_token(kv), cfg.max_position_embeddings
    else:  # a GGUF not converted yet: its header says it all
        weights, meta = memory_plan.gguf_weight_bytes(source, quantization)
        per_token = memory_plan.gguf_kv_bytes_per_token(meta, kv)
        window = meta.get(f"{meta.get('general.architecture')}.context_length") or 2048
    memory_plan.check_fits(weights, per_token, max_model_len or window, memory_plan.available_memory(device), str(source))


def _layer_formats(formats: dict[str, str]) -> dict[str, str]:
    """{module name: format} -> {layer type: format(s)}, for the load report."""
    by_type: dict[str, set[str]] = {}
    for name, fmt in formats.items():
        by_type.setdefault(name.rpartition(".")[2], set()).add(fmt)
    return {kind: "/".join(sorted(fmts)) for kind, fmts in sorted(by_type.items())}


def _to_cuda(tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Host -> GPU through two pinned staging buffers and non-blocking copies on a side stream,
    so the CPU fills one buffer while the GPU drains the other."""
    max_bytes = max(t.numel() * dtype.itemsize for t in tensors.values())
    staging = [torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    ready = [None, None]
    stream = torch.cuda.Stream(device=device)
    out: dict[str, torch.Tensor] = {}
    for i, (name, t) in enumerate(tensors.items()):
        slot = i % 2
        if ready[slot] is not None:
            ready[slot].synchronize()  # the previous copy out of this buffer has finished
        nbytes = t.numel() * dtype.itemsize
        pinned = staging[slot][:nbytes].view(dtype).view(t.shape)
        pinned.copy_(t)
        with torch.cuda.stream(stream):
            out[name] = pinned.to(device, non_blocking=True)
            ready[slot] = torch.cuda.Event()
            ready[slot].record(stream)
    stream.synchronize()
    return out


def _warmup(model: DecoderForCausalLM, cfg: ModelConfig, device, dtype,
            maps: list[safetensors_io.MappedFile]) -> None:
    for module in model.modules():  # oneDNN weight layouts now, not on the first request
        if isinstance(module, Linear):
            module.prepare()
            # NOTE: the packed copy is what runs; the float original (a view of the mapped file)
            # gives its pages back instead of doubling the linears' memory.
            if module.is_packed:
                any(m.release(module.weight) for m in maps)
    # Two tokens: every weight is read once (its pages mapped in) and the prompt path runs, for the
    # least compute. Against 8 tokens, on a 7B Q4_K_M warm start (4 interleaved starts each, 2 cores):
    # this phase's median 1.05 s against 1.39 s, and the first request no slower (oneDNN primitives
    # are made per shape, so more rows here would not have warmed the first request's anyway).
    tokens = 2
    cache = SingleSequenceCache(cfg, max_len=tokens, dtype=dtype, device=device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    with torch.inference_mode():
        cache.begin(tokens)
        model.compute_logits(model(ids, torch.arange(tokens, device=device), cache)[-1:])


def load(model: "str | ModelSource | None" = None, *, device: str | None = None, dtype: str | None = None,
         max_model_len: int | None = None, warmup: bool = True, quantization: str = "auto",
         report: LoadReport | None = None, kv_cache_dtype: str = "auto", pooling: str = "auto",
         convert_in_memory: bool = False) -> LoadedModel:
    """`convert_in_memory` (brisk serve): a GGUF's first start runs from its conversion built in memory and leaves
    the cache to be written behind it (`loaded.conversion.write_behind`), instead of writing it first.
    `quantization`: auto (a GGUF keeps its quantized types; a float checkpoint stays float, and
    on CPU a bfloat16/float16 one keeps its 16-bit weights: `_auto_weights`), none (everything
    float), int8 or int4 (every weight matrix quantized in blocks of 32), bf16 or f16 (weights
    stored in 16 bits, activations float32).
    `kv_cache_dtype` (brisk/kv_dtype.py) sizes the memory check's one max-length sequence."""
    report = report or LoadReport()
    if quantization not in QUANTIZATION_CHOICES:
        raise BriskError(f"--quantization {quantization!r} is not supported; use "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    with report.phase("resolve"):
        source = resolve(model)
        cache_root = cache_dir()
        dev = pick_device(device)
        torch_dtype = pick_dtype(dtype, dev)
    report.source, report.path = source.name, str(source.path)
    report.device, report.dtype = str(dev), str(torch_dtype).removeprefix("torch.")
    if quantization in quant.HALF_METHODS and source.kind == "gguf":
        raise BriskError(f"--quantization {quantization} stores a safetensors checkpoint's float weights in 16 bits; "
                         f"{source.path.name} is a GGUF: use --quantization auto (its own types, F16/BF16 matrices "
                         "kept 16-bit), none, int8 or int4")
    model_dir = source.path
    # a GGUF's 16-bit matrices are converted as stored (in "auto") and kept so at load (bf16/f16)
    conversion = quantization
    if source.kind == "gguf":
        report.format = "gguf"
        model_dir = gguf_convert.converted_dir(cache_root, source.path, conversion)
    if quantization == "auto":
        quantization = _auto_weights(source, model_dir, dtype, dev)
    with report.phase("memory_check"):
        kv = resolve_kv_dtype(kv_cache_dtype, str(torch_dtype).removeprefix("torch."), dev.type)
        _check_memory(source.path, model_dir, quantization, max_model_len, dev, torch_dtype, kv)
    image = None  # a first start's conversion in memory (convert_in_memory)
    read_dir = model_dir  # where config.json and the tokenizer are read (the image's folder until it is in place)
    if source.kind == "gguf":
        if (model_dir / "config.json").exists():
            report.conversion_cache = "hit"
        else:
            report.conversion_cache = "miss"
            if convert_in_memory:
                from brisk.loading.conversion_image import ConvertedImage

                image = ConvertedImage(source.path, model_dir, conversion)
                read_dir, timings = image.folder, image.timings
            else:
                timings = gguf_convert.convert(source.path, model_dir, conversion)
            for name, ms in timings.items():
                report.add(name, ms)
    else:
        report.format = "safetensors"

    with report.phase("config"):
        raw_config = _read_json(read_dir / "config.json")
        cfg = ModelConfig.from_hf_dict(raw_config, str(model_dir / "config.json"))
        embedding = pooling_of(read_dir, raw_config, pooling)
        if embedding is not None:  # no LM head: the final hidden states are the output
            cfg = cfg.replace(tie_word_embeddings=False)
            report.pooling = embedding.describe()
        report.parameters_total, report.parameters_active = cfg.parameter_counts()
        if cfg.moe is not None:
            report.experts = (f"{cfg.moe.experts_per_token} of {cfg.moe.num_experts} experts a token in "
                              f"{len(cfg.moe.layers)} of {cfg.num_layers} layers")
        max_len = max_model_len or cfg.max_position_embeddings
        if max_len <= 0:
            raise BriskError(f"--max-model-len {max_len} must be positive")
    with report.phase("open_mmap"):
        if image is None:
            shards, maps, prefetcher = safetensors_io.load_checkpoint(model_dir)
        else:
            shards, maps, prefetcher = [image.tensors()], [image.mapped], safetensors_io.ShardPrefetcher([])
    with report.phase("module_build"):
        with torch.device("meta"):
            net = DecoderForCausalLM(cfg)
            if embedding is not None:
                net.lm_head = torch.nn.Identity()
        tensors = model_state(shards, cfg, head=embedding is None)
        if quantization in quant.QUANTIZERS and not any(_is_quantized(n) for n in tensors):
            _quantize_at_load(tensors, quantization, maps)
        if dev.type != "cpu":  # NOTE: the quantized kernels are CPU kernels; elsewhere weights run in float
            widened = sorted({_format_of(tensors, n) for n in tensors if n.endswith(".qweight")})
            if widened:
                report.notes.append(f"{', '.join(widened)} weights widened to {report.dtype} on {dev}: brisk's "
                                    "quantized kernels run on the CPU")
            _dequantize_all(tensors)
        report.weight_bytes = sum(t.numel() * (t.element_size() if _is_quantized(n) or not t.is_floating_point()
                                               else torch_dtype.itemsize) for n, t in tensors.items())  # as placed
        formats = quant.install(net, tensors, cfg.tie_word_embeddings, torch_dtype)
        formats.update(moe.install_experts(net, tensors))
        report.weight_formats = _layer_formats(formats)
        if source.kind == "gguf" and "MXFP4" in gguf_convert.linear_types(source.path) and \
                "mxfp4" not in report.weight_formats.values():
            kept = sorted({report.weight_formats.get(k, "float") for k in ("gate_up_proj", "down_proj")})
            report.notes.append(f"the file's MXFP4 weights are stored as {', '.join(kept)} (rows not in whole tiles "
                                "of 8, or --quantization)")
        missing = sorted(_expected_names(net) - tensors.keys())
        if missing:
            raise ModelLoadError(
                f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}; "
                "it does not match config.json"
            )
        extra = sorted(tensors.keys() - _expected_names(net))
        if extra:
            raise ModelLoadError(f"{model_dir}: checkpoint has unexpected tensor(s), e.g. {extra[0]}")
        try:
            net.load_weights(_place(tensors, dev, torch_dtype, prefetcher), max_positions=max_len, device=dev)
        except RuntimeError as e:  # shape mismatches between checkpoint and config.json
            first = str(e).strip().splitlines()[-1].strip()
            raise ModelLoadError(f"{model_dir}: weights do not match config.json ({first})") from None
        net.eval().requires_grad_(False)
    with report.phase("tokenizer"):
        tokenizer = Tokenizer.from_dir(read_dir, _eos_ids(read_dir, cfg))
        if cfg.architecture == "GptOssForCausalLM":  # a harmony reply ends at <|return|> or at a call's <|call|>
            stops = [tokenizer.fast.token_to_id(t) for t in HARMONY_STOPS]
            tokenizer.eos_token_ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *(i for i in stops if i is not None)]))
    if warmup:
        with report.phase("first_forward"):
            _warmup(net, cfg, dev, torch_dtype, maps)
    return LoadedModel(net, tokenizer, cfg, model_dir, dev, torch_dtype, max_len, report, source.name, maps, embedding,
                       image)
