import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def brisk_cache(tmp_path_factory) -> Path:
    """A fresh cache directory for the whole run, so the GGUF conversion path runs too."""
    path = tmp_path_factory.mktemp("brisk-cache")
    old = os.environ.get("BRISK_CACHE")
    os.environ["BRISK_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("BRISK_CACHE", None)
    else:
        os.environ["BRISK_CACHE"] = old


@pytest.fixture(scope="session")
def demo(brisk_cache):
    from brisk.loading.loader import load

    return load("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def demo_fp32(brisk_cache):
    """The demo model dequantized to float32 (`--quantization none`): what HF computes."""
    from brisk.loading.loader import load

    return load("smollm2-135m-instruct", quantization="none")


@pytest.fixture(scope="session")
def demo_gguf_path() -> Path:
    from brisk.models.registry import resolve

    return resolve("smollm2-135m-instruct").path


@pytest.fixture(scope="session")
def hf_reference(demo_gguf_path):
    """HF transformers' own load of the same GGUF (it dequantizes with the gguf package)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=demo_gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(demo_gguf_path.parent, dtype=torch.float32, **kwargs)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_gguf_path.parent, **kwargs)
    return model, tokenizer
