"""A Hugging Face checkpoint's weight files, found without reading them (torch-free: `brisk serve`'s pre-flight
checks a directory has its weights before the port is bound and torch is imported)."""

from __future__ import annotations

import json
from pathlib import Path

from brisk.errors import ModelLoadError


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, in shard order."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: malformed shard index ({e}); re-download it") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no weights (no *.safetensors file); download the model's safetensors into "
                             "it, or pass a .gguf file")
    for file in files:
        if not file.exists():
            raise ModelLoadError(f"{file}: shard listed in the index is missing; re-download the model")
    return files
