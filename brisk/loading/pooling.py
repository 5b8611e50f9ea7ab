"""Whether a model is an embedding model, and how it pools: from the model's own files, as sentence-transformers
and llama.cpp read them. Torch-free.

- A Hugging Face directory with sentence-transformers' `modules.json`: its Pooling module's `config.json` says the
  mode (`pooling_mode_lasttoken`, `_mean_tokens`, `_cls_token`; Qwen3-Embedding pools the last token), and a
  Normalize module means the vectors are L2-normalised.
- A GGUF: `{arch}.pooling_type` as llama.cpp's converter writes it from those same files (1 mean, 2 cls, 3 last;
  llama-server normalises its embeddings, so brisk does too).
- `--pooling last|mean|cls` serves any model as an embedding model with that pooling (normalised); `--pooling none`
  serves it for generation whatever its files say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brisk.errors import ModelLoadError

MODES = ("last", "mean", "cls")
CHOICES = ("auto", "none", *MODES)
# llama.cpp's pooling types (llama.h enum llama_pooling_type)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
GGUF_RANK = 4
CONFIG_KEY = "brisk_pooling"  # brisk's GGUF conversion writes a GGUF's pooling into config.json under this key


@dataclass(frozen=True)
class Pooling:
    mode: str  # last | mean | cls
    normalize: bool  # L2-normalised vectors
    source: str  # where it was read ("modules.json", "GGUF pooling_type", "--pooling")

    def describe(self) -> str:
        return f"{self.mode} pooling{', L2-normalised' if self.normalize else ''} (from {self.source})"


def pooling_of(model_dir: Path, config: dict[str, Any], override: str = "auto") -> Pooling | None:
    """The model's pooling, or None for a generative model."""
    if override not in CHOICES:
        raise ModelLoadError(f"--pooling {override!r}: use one of {', '.join(CHOICES)}")
    if override == "none":
        return None
    if override != "auto":
        return Pooling(override, True, "--pooling")
    written = config.get(CONFIG_KEY)
    if isinstance(written, dict):
        return Pooling(written["mode"], bool(written.get("normalize", True)), written.get("source", "GGUF pooling_type"))
    return _sentence_transformers(model_dir)


def _sentence_transformers(model_dir: Path) -> Pooling | None:
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        pooling_module = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
        if pooling_module is None:
            return None
        pooling_file = model_dir / pooling_module.get("path", "") / "config.json"
        config = json.loads(pooling_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ModelLoadError(f"{model_dir}: sentence-transformers' modules.json or its pooling config cannot be read "
                             f"({e}); fix the files, or pass --pooling last|mean|cls") from None
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    flags = {"last": config.get("pooling_mode_lasttoken"), "mean": config.get("pooling_mode_mean_tokens"),
             "cls": config.get("pooling_mode_cls_token")}
    named = config.get("pooling_mode")
    chosen = [mode for mode, on in flags.items() if on] or ([{"lasttoken": "last"}.get(named, named)] if named else [])
    if len(chosen) != 1 or chosen[0] not in MODES:
        raise ModelLoadError(f"{pooling_file}: pooling {config} is not one brisk runs (exactly one of last-token, mean "
                             "or CLS pooling); pass --pooling last|mean|cls to choose")
    return Pooling(chosen[0], normalize, "modules.json")


def from_gguf(arch: str, meta: dict[str, Any], source: str) -> dict[str, Any] | None:
    """A GGUF's pooling as config.json keeps it (CONFIG_KEY), or None for a generative GGUF."""
    kind = meta.get(f"{arch}.pooling_type")
    if kind in (None, 0):
        return None
    if kind == GGUF_RANK:
        raise ModelLoadError(f"{source}: a reranker GGUF (pooling_type rank) is not one brisk serves; serve an "
                             "embedding model (mean, cls or last pooling)")
    if kind not in GGUF_POOLING:
        raise ModelLoadError(f"{source}: GGUF pooling_type {kind} is unknown to brisk (1 mean, 2 cls, 3 last)")
    return {"mode": GGUF_POOLING[kind], "normalize": True, "source": "GGUF pooling_type"}
