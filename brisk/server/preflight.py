"""`brisk serve`'s checks before anything heavy is imported or read: the model path and format,
`--max-model-len` against the model's window, every engine flag, an explicit KV budget against
one max-length sequence, and the port, which is bound here (so "listening" is never logged for
a port that another process holds). Each failure is one BriskError line, exit 2, in about the
time Python takes to start. Torch-free and FastAPI-free.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brisk.errors import BriskError
from brisk.kv_dtype import KVDtype, resolve as resolve_kv_dtype



@dataclass
class Preflight:
    source: Any  # brisk.models.registry.ModelSource
    config: dict[str, Any]  # the model's HF-style config
    window: int  # the model's context window (max_position_embeddings)
    max_model_len: int  # what the server will use
    sock: socket.socket | None  # bound and listening (None: checked without binding, for Ray Serve's proxy)
    chat_template: str | None = None  # --chat-template's text, compiled once here to check it


def model_config(source) -> dict[str, Any]:
    """The HF-style config of a resolved model source, from its metadata alone. A GGUF is also held
    to what brisk can convert: its architecture, tokenizer type, pre-tokenizer and tensor types."""
    if source.kind == "gguf":
        from brisk.loading.dequant import check_type
        from brisk.loading.gguf_header import hf_config, read_gguf_header
        from brisk.loading.gguf_tokenizer import check_vocabulary

        header = read_gguf_header(source.path)
        config = hf_config(header.metadata, True, str(source.path))
        check_vocabulary(header.metadata, str(source.path))
        for tensor in header.tensors:
            check_type(str(source.path), tensor.name, tensor.type_name)
        return config
    path = Path(source.path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise BriskError(f"{path}: cannot read the model config ({e})") from None
    from brisk.config import ModelConfig
    from brisk.loading.checkpoint import checkpoint_files

    ModelConfig.from_hf_dict(config, str(source.path))  # an architecture brisk cannot run, named before the weights
    checkpoint_files(Path(source.path))  # weights present (every shard of an index): before the port is bound
    return config


def check_window(args: argparse.Namespace, config: dict[str, Any], source: str) -> tuple[int, int]:
    """(window, max_model_len); refuses a --max-model-len over the window."""
    window = int(config.get("max_position_embeddings") or 2048)
    wanted = args.max_model_len
    if wanted is not None and wanted < 1:
        raise BriskError(f"--max-model-len must be >= 1, got {wanted}")
    if wanted is not None and wanted > window:
        raise BriskError(f"--max-model-len {wanted} exceeds the model's context window of {window} tokens "
                         f"({source}: max_position_embeddings); positions past it were never trained and brisk "
                         f"has no RoPE-scaling override; use --max-model-len {window} or less")
    return window, wanted or window


def kv_dtype(args: argparse.Namespace) -> KVDtype | None:
    """The KV cache's dtype when it is known without torch: an explicit --kv-cache-dtype, or auto
    with an explicit --dtype or on a CPU run (float32 compute). None on a machine that may have a
    GPU (auto picks bfloat16 there, and the GPU's free memory is not known here)."""
    cpu = args.device == "cpu" or (args.device == "auto" and not os.path.exists("/proc/driver/nvidia/version"))
    device = "cpu" if cpu else args.device
    if args.kv_cache_dtype != "auto":
        return resolve_kv_dtype(args.kv_cache_dtype, "float32", device)
    if args.dtype in ("float32", "bfloat16", "float16"):
        return resolve_kv_dtype("auto", args.dtype, device)
    return resolve_kv_dtype("auto", "float32", "cpu") if cpu else None


def check_host_tier(host_bytes: int) -> None:
    """--kv-cache-host-bytes past the host's available memory: one line now (the engine checks again once its
    pool is sized)."""
    from brisk.config import host_available_memory

    free = host_available_memory()
    if host_bytes > free:
        raise BriskError(f"--kv-cache-host-bytes {host_bytes / 2**30:.1f} GiB is more than the {free / 2**30:.1f} GiB "
                         "of host memory available; give it less")


def check_kv_budget(args: argparse.Namespace, config: dict[str, Any], max_model_len: int, source: str) -> None:
    """With an explicit --kv-cache-memory: it must hold one max-length sequence (the engine's own
    rule, checked now instead of after the weights have loaded)."""
    from brisk.engine.factory import engine_configs
    from brisk.config import ModelConfig

    cache, _ = engine_configs(args, max_model_len)  # every engine flag, validated
    check_host_tier(cache.kv_cache_host_bytes)
    kv = kv_dtype(args)
    if cache.kv_cache_memory is None or kv is None:
        return
    per_token = ModelConfig.from_hf_dict(config, source).kv_bytes_per_token(kv)
    cache.num_blocks(per_token, max_model_len, available_bytes=0)


SHIPPED_TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


def catalog_template(source) -> str | None:
    """The template brisk ships for a catalog model (the demo's renders tools), when --chat-template is not given."""
    from brisk.models.registry import CATALOG

    entry = CATALOG.get(source.name)
    return entry.chat_template if entry is not None else None


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file, the name of a template brisk ships (`chatml_tools`), or the template
    itself; compiled now, so a syntax error is one line at start, not a 500 on the first chat."""
    if value is None:
        return None
    path = Path(value)
    shipped = SHIPPED_TEMPLATES / f"{value}.jinja"
    if not path.is_file() and value.isidentifier() and shipped.is_file():
        path = shipped
    if len(value) < 4096 and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BriskError(f"--chat-template {value}: cannot read it ({e})") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise BriskError(f"--chat-template {value[:80]!r}: no such file, and not a Jinja template (no {{{{ or {{%)")
    import jinja2

    from brisk.tokenizer import compile_chat_template

    try:
        compile_chat_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise BriskError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return text


def bind(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: a port in use is an error before any loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BriskError(f"--host {host}: cannot resolve it ({e.strerror or e})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = " (is another server using it? pick another --port)" if e.errno == 98 else ""
        raise BriskError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


def preflight(args: argparse.Namespace, bind_port: bool = True) -> Preflight:
    from brisk.models.registry import resolve

    from brisk.config import ModelConfig

    from brisk import switches
    from brisk.engine.factory import check_device

    switches.check_all()  # a mistyped BRISK_* value: one line now, not when its path first runs
    check_device(args.device)  # --device cuda without a usable GPU: before the model is even resolved
    source = resolve(args.model)  # a missing or unreadable model: ModelLoadError, one line
    config = model_config(source)
    ModelConfig.from_hf_dict(config, str(source.path))  # an architecture brisk cannot run: one line, now
    window, max_model_len = check_window(args, config, str(source.path))
    check_kv_budget(args, config, max_model_len, str(source.path))
    if getattr(args, "kv_cache_dir", None):  # an unwritable folder: one line now, not after the load
        from brisk.engine.kv_cache.disk_tier import check_folder

        check_folder(args.kv_cache_dir)
    from brisk.engine.factory import speculative_config

    speculative_config(args)
    template = chat_template(args.chat_template or catalog_template(source))
    sock = bind(args.host, args.port) if bind_port else None
    return Preflight(source, config, window, max_model_len, sock, template)
