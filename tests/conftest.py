import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The suite tests the CPU paths, and `--device auto` picks a visible GPU: under a CUDA torch, 51 of
# its tests ran on the GPU and failed (2026-12-04, an H200). So GPUs are hidden from this process
# and from the servers it starts, before torch looks for them, unless BRISK_TEST_CUDA=1 asks for
# them; then run tests/test_cuda.py alone: `BRISK_TEST_CUDA=1 pytest tests/test_cuda.py`.
if os.environ.get("BRISK_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


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



def pytest_sessionstart(session):
    """The CPU and the kernel paths it runs, at the top of every run (even with -q): a CI log says which ISA
    paths ran (the tests pinned to a path this CPU lacks are skipped, with that reason, in the -rs summary)."""
    from isa_paths import report

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(report())
