"""The engine's flags and how an engine is built from them, in one place below every user of
them: `brisk serve` and `brisk generate` (the CLI), pre-flight, `kv-plan` (which checks the flags it
recommends with this parser) and each Ray Serve replica.

Torch-free at import: the heavy imports happen inside `build_engine` / `load_async_engine`.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

from brisk import argtypes
from brisk.config import DEFAULT_BLOCK_SIZE, QUANTIZATION_CHOICES
from brisk.errors import BriskError
from brisk.kv_dtype import CHOICES as KV_CHOICES, parse_name as kv_dtype_name, resolve as resolve_kv_dtype

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
POOLING_CHOICES = ("auto", "none", "last", "mean", "cls")  # brisk.loading.pooling.CHOICES (torch-free here)


def add_model_args(p) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="Hugging Face model directory, .gguf file, or catalog name (default: smollm2-135m-instruct)")
    p.add_argument("--device", default="auto", type=argtypes.device,
                   help="auto (CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16; "
                        "an explicit one also casts a float checkpoint's weights to it")
    p.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATION_CHOICES,
                   help="weight format: auto (a GGUF keeps its quantized types, e.g. Q4_0 as int4; a float "
                        "checkpoint stays float, and on CPU a bfloat16/float16 one keeps its 16-bit weights), "
                        "none (dequantize to --dtype), int8 or int4 (every weight matrix quantized in blocks "
                        "of 32 at load), bf16 or f16 (weights stored in 16 bits, float32 activations)")
    p.add_argument("--max-model-len", type=argtypes.positive, default=None,
                   help="context window (default: the model's)")
    p.add_argument("--pooling", default="auto", choices=POOLING_CHOICES,
                   help="serve an embedding model (/v1/embeddings): auto (from the model's files: sentence-transformers' "
                        "modules.json, a GGUF's pooling type), none (generation, whatever the files say), or last, "
                        "mean, cls (this pooling, L2-normalised, for any model)")
    p.add_argument("--verbose", "-v", action="store_true", help="print the load report; tracebacks on errors")


def add_engine_args(p) -> None:
    from brisk.engine.scheduler import SchedulerConfig  # torch-free: the defaults live with the scheduler

    memory = p.add_mutually_exclusive_group()
    memory.add_argument("--kv-cache-memory", default=None,
                        help="KV cache size, e.g. 2GiB (default: 20%% of the memory available after the weights)")
    memory.add_argument("--gpu-memory-utilization", type=argtypes.number(), default=None, metavar="FRACTION",
                        help="vLLM's flag: the KV cache takes this fraction of the device's free memory once the "
                             "weights are loaded (on CPU: of available RAM), in (0, 0.95]")
    p.add_argument("--kv-cache-dtype", default="auto", type=kv_dtype_name, metavar="{" + ",".join(KV_CHOICES) + "}",
                   help="the KV cache's element type (vLLM's names). auto: bfloat16 on CPUs with AVX-512 BF16 "
                        "when the model computes in float32, else the model's dtype. fp8 = fp8_e4m3; int8 keeps "
                        "one scale per token and KV head (like llama.cpp's q8_0)")
    p.add_argument("--block-size", type=argtypes.positive, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="keep every full KV block of the prefix cache on disk in DIR as well, so that cached prompts "
                        "survive a restart and are shared by servers of the same model on one machine (keyed by "
                        "the model's files, the KV dtype and the block size); off by default")
    p.add_argument("--kv-cache-disk-bytes", default="16GiB", metavar="SIZE",
                   help="the most --kv-cache-dir holds, e.g. 16GiB (least recently used blocks go first)")
    p.add_argument("--kv-cache-host-bytes", default=None, metavar="SIZE",
                   help="keep the cached KV blocks the pool evicts in host memory, up to SIZE (e.g. 8GiB; least "
                        "recently used first out), and take them back instead of recomputing a returning prefix; "
                        "looked up after the pool and before --kv-cache-dir. Off by default")
    p.add_argument("--max-num-seqs", type=argtypes.positive, default=SchedulerConfig.max_num_seqs,
                   help=f"sequences batched per step (default {SchedulerConfig.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive,
                   default=SchedulerConfig.max_num_batched_tokens,
                   help=f"token budget per step (default {SchedulerConfig.max_num_batched_tokens})")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of a common prompt prefix (default on)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="the same as --no-enable-prefix-caching")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="a request's greedy output depends on the request only: not on what it is batched with "
                        "nor on the prefix cache (prompt tokens attend row by row through the compiled kernel, "
                        "in tiles). Default: on wherever that kernel runs (CPU, float32/bfloat16 KV); "
                        "--batch-invariant makes it an error where it cannot; --no-batch-invariant: prompt "
                        "chunks take SDPA (vLLM's VLLM_BATCH_INVARIANT, SGLang's "
                        "--enable-deterministic-inference)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's flag: speculative decoding, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}' "
                        "(off by default; see docs/speculative.md)")


def engine_parser() -> argparse.ArgumentParser:
    """A parser of the engine's flags alone (kv-plan checks the flags it prints with it)."""
    p = argparse.ArgumentParser(prog="brisk serve", add_help=False, allow_abbrev=False)
    add_model_args(p)
    add_engine_args(p)
    return p


def check_device(device: str) -> None:
    """`--device cuda[:N]` needs a CUDA build of torch and an NVIDIA driver: known from files,
    without importing torch (which takes seconds), so the mistake is one line at start."""
    if not device.startswith("cuda"):
        return
    spec = importlib.util.find_spec("torch")
    version = Path(spec.origin).with_name("version.py") if spec and spec.origin else None
    text = version.read_text(encoding="utf-8") if version and version.is_file() else ""
    def built_with(name: str) -> bool | None:  # None: the file does not say
        found = re.search(rf"^{name}\b[^=]*=\s*(.+)$", text, re.M)
        return None if found is None else found.group(1).strip() != "None"

    if built_with("hip"):  # ROCm builds call their GPUs "cuda" too
        if not Path("/dev/kfd").exists():
            raise BriskError(f"--device {device}: no AMD GPU driver on this machine (/dev/kfd is missing); "
                             "use --device cpu")
        return
    if built_with("cuda") is False:
        tag = re.search(r"^__version__\s*=\s*'([^']+)'", text, re.M)
        raise BriskError(f"--device {device}: this torch build has no CUDA (torch {tag.group(1) if tag else '?'}); "
                         "use --device cpu, or install a CUDA build of torch")
    gpus = Path("/proc/driver/nvidia/gpus")
    if not Path("/proc/driver/nvidia/version").exists():
        raise BriskError(f"--device {device}: no NVIDIA GPU driver on this machine (/proc/driver/nvidia/version "
                         "is missing); use --device cpu")
    if ":" in device and gpus.is_dir():
        index, count = int(device.split(":")[1]), len(list(gpus.iterdir()))
        if index >= count:
            raise BriskError(f"--device {device}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})")


def _size_flag(flag: str, text: str) -> int:
    from brisk.config import parse_memory

    try:
        return parse_memory(text)
    except ValueError as e:
        raise BriskError(f"{flag}: {e}") from None


def engine_configs(args: argparse.Namespace, max_model_len: int):
    """The engine's cache and scheduler configs from serve/generate flags (torch-free: kv-plan
    validates the flags it recommends with this)."""
    from brisk.config import CacheConfig, parse_memory
    from brisk.engine.scheduler import SchedulerConfig

    if args.kv_cache_dtype != "auto":  # the CPU can read it (raises before anything loads)
        device = getattr(args, "device", None) or "auto"
        resolve_kv_dtype(args.kv_cache_dtype, "float32", "cpu" if device == "auto" else device)
    try:
        memory = parse_memory(args.kv_cache_memory) if args.kv_cache_memory else None
        fraction = {} if args.gpu_memory_utilization is None else {"kv_cache_fraction": args.gpu_memory_utilization}
        tiers = {}  # the KV tiers past the pool
        if getattr(args, "kv_cache_dir", None):
            tiers = {"kv_cache_dir": args.kv_cache_dir,
                     "kv_cache_disk_bytes": _size_flag("--kv-cache-disk-bytes", args.kv_cache_disk_bytes)}
        if getattr(args, "kv_cache_host_bytes", None):
            tiers["kv_cache_host_bytes"] = _size_flag("--kv-cache-host-bytes", args.kv_cache_host_bytes)
        cache = CacheConfig(block_size=args.block_size, kv_cache_memory=memory,
                            enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                            **fraction, **tiers)
        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=max_model_len)
    except ValueError as e:
        message = str(e)
        if "kv_cache_fraction" in message:  # name the flag the user gave
            message = f"--gpu-memory-utilization must be in (0, 0.95], got {args.gpu_memory_utilization}"
        raise BriskError(message) from None
    return cache, sched


def speculative_config(args: argparse.Namespace):
    """--speculative-config parsed and checked (torch-free, so `serve` refuses a bad one at start)."""
    from brisk.engine.spec_decode.config import SpeculativeConfig

    if args.speculative_config is None:
        return None
    config = SpeculativeConfig.parse(args.speculative_config)
    if config.method == "draft_model":
        from brisk.models.registry import resolve

        try:
            resolve(config.model)
        except BriskError as e:
            raise BriskError(f"--speculative-config model: {e}") from None
    return config


def build_engine(args: argparse.Namespace, loaded):
    """An LLMEngine over a loaded model, configured by the flags."""
    from brisk.engine.engine import LLMEngine

    cache, sched = engine_configs(args, loaded.max_model_len)
    speculative = speculative_config(args)
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        from brisk.loading.loader import load

        # the target's device, dtype and quantization; positions up to the target's context
        draft = load(speculative.model, device=str(loaded.device), dtype=args.dtype, quantization=args.quantization,
                     max_model_len=loaded.max_model_len, warmup=False, kv_cache_dtype=args.kv_cache_dtype)
    return LLMEngine(loaded, cache, sched, seed=getattr(args, "seed", None) or 0, speculative=speculative,
                     draft=draft, batch_invariant=args.batch_invariant)


def load_async_engine(args: argparse.Namespace, max_model_len: int, chat_template: str | None, report,
                      source=None):
    """Load the model (`source`: the one pre-flight resolved, else `args.model`) and start its engine
    thread (single-process serve, and each Ray Serve replica).

    The loading runs on a thread that then exits (brisk.engine.omp_teams): the caller's thread may
    live on (Ray Serve's constructor thread does), and an OpenMP team left on it would make the
    engine's own team sleep at every barrier."""
    from brisk.engine.omp_teams import call_in_own_thread

    return call_in_own_thread(_load_async_engine, args, max_model_len, chat_template, report, source)


def _load_async_engine(args: argparse.Namespace, max_model_len: int, chat_template: str | None, report,
                       source=None):
    import logging

    with report.phase("imports"):
        from brisk.engine.async_engine import AsyncLLMEngine
        from brisk.loading.loader import load
    loaded = load(source or args.model, device=args.device, dtype=args.dtype, max_model_len=max_model_len,
                  quantization=args.quantization, report=report, kv_cache_dtype=args.kv_cache_dtype,
                  pooling=args.pooling, convert_in_memory=True)
    if chat_template is not None:
        loaded.tokenizer.set_chat_template(chat_template)
    with report.phase("engine"):
        built = build_engine(args, loaded)
        report.kv_cache_dtype = built.kv_dtype.name
        engine = AsyncLLMEngine(built)
    if loaded.conversion is not None:  # a first start: its conversion cache is written while the engine idles
        loaded.conversion.write_behind(busy=engine.busy)
    for line in report.lines():
        logging.getLogger("brisk.server").info("%s", line)
    return engine

