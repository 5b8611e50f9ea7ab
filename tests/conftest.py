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


# Modules `pytest -m 'not slow'` skips (make test and CI run everything). Besides those marked in their own
# file (the Ray cluster, the fuzzers, the attack suite, the HF reference of the demo), these: each starts
# servers or builds and compares whole models, and together they are most of the suite's ~20 minutes on 2 cores.
SLOW_MODULES = {
    "test_doctor.py",  # doctor runs against fake and real servers
    "test_model_families.py",  # every family against transformers and llama.cpp, served and doctored
    "test_engine_batching.py",  # 64 prompts alone, in waves and preempted, float32 and int4
    "test_speculative.py",  # draft and n-gram speculation against plain decoding
    "test_kvplan.py",  # plans checked against real engine runs
    "test_server_api.py", "test_cli.py", "test_serve_process.py", "test_hardening.py", "test_bench.py",
    "test_server_failures.py", "test_fault_isolation.py", "test_structured_outputs.py", "test_tool_calls.py",
    "test_embeddings.py", "test_responses_api.py", "test_context_guard.py", "test_observability.py",
    "test_top.py", "test_reasoning.py",  # live servers
    "test_webui.py",  # a headless browser
    "test_kv_dtypes.py", "test_moe.py", "test_gguf_tokenizers.py", "test_grammar_vocabulary.py",
    "test_dequant.py",  # whole-model references
    "test_kv_disk_tier.py",  # engines restarted on a disk tier, and brisk serve across SIGTERM
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
