"""llama.cpp's own test material (scripts/fetch_llamacpp.py, run by `make test`): its GGUF converter,
tokenizer test vocabularies and real chat templates, from the llama-cpp-python sdist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMACPP = Path(os.environ.get("BRISK_LLAMACPP", REPO / ".venv" / "llama.cpp"))


def llamacpp_dir() -> Path:
    if not (LLAMACPP / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"llama.cpp's test material is not in {LLAMACPP}: run `make test` (or "
                           f"`python scripts/fetch_llamacpp.py {LLAMACPP}`)")
    return LLAMACPP


def convert_hf_to_gguf(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Write `hf_dir` as a GGUF with llama.cpp's `convert_hf_to_gguf.py`, as a user would."""
    root = llamacpp_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "pydeps"), str(root / "gguf-py")])}
    done = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                           "--outfile", str(out)], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{done.stderr[-3000:]}")
    return out
