"""brisk.kernels.paths: the one place that picks each compute path, read by the engine's parts."""

import logging

import pytest
import torch

from brisk.engine.attention import KernelPagedAttention, TorchPagedAttention, attention_backend
from brisk.errors import BriskError
from brisk.kernels import paths


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(paths, "_logged", None)
    for name in ("BRISK_ATTENTION", "BRISK_DECODE_STACK", "BRISK_MATMUL"):
        monkeypatch.delenv(name, raising=False)


def test_default_cpu_paths_use_the_compiled_kernels():
    got = paths.compute_paths("cpu")
    if not got.compiled:
        pytest.skip("no compiled kernels in this checkout (`make` builds them)")
    assert got.attention == "kernel" and got.decode_stack and got.kernel_level >= 1
    assert got.attention_isa in ("avx512fp16", "avx512", "avx2", "portable")
    assert attention_backend(torch.device("cpu")) is KernelPagedAttention


def test_attention_multiplies_fp8_in_float16_exactly_where_the_cpu_has_avx512fp16():
    """The attention kernel's ISA follows the CPU's flags (Linux /proc/cpuinfo): avx512fp16 where the
    CPU has AVX512-FP16 (fp8 KV then multiplies in float16, and `fp8_in_float16` says so), else not."""
    from brisk import kernels
    from brisk.kv_dtype import FP8_E4M3, FP8_E5M2, INT8

    got = paths.compute_paths("cpu")
    if not got.compiled:
        pytest.skip("no compiled kernels in this checkout (`make` builds them)")
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags here")
    fp16 = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_fp16"))
    assert (got.attention_isa == "avx512fp16") == fp16
    assert kernels.fp8_in_float16(FP8_E4M3, 64) == kernels.fp8_in_float16(FP8_E5M2, 128) == fp16
    assert not kernels.fp8_in_float16(FP8_E4M3, 80) and not kernels.fp8_in_float16(INT8, 64)
    assert ("fp8 KV multiplied in float16" in got.describe()) == fp16


def test_switches_rule_paths_out_and_the_engine_follows(monkeypatch):
    monkeypatch.setenv("BRISK_ATTENTION", "torch")
    got = paths.compute_paths("cpu")
    assert got.attention == "torch" and not got.decode_stack  # the stack runs on the attention kernel
    assert attention_backend(torch.device("cpu")) is TorchPagedAttention
    monkeypatch.setenv("BRISK_ATTENTION", "auto")
    monkeypatch.setenv("BRISK_DECODE_STACK", "off")
    monkeypatch.setenv("BRISK_MATMUL", "torch")
    got = paths.compute_paths("cpu")
    assert not got.decode_stack and got.float_matmul == "torch"


def test_other_devices_take_the_torch_paths():
    got = paths.compute_paths("meta")
    assert got.attention == "torch" and got.float_matmul == "torch" and not got.decode_stack


def test_a_bad_switch_is_one_error_naming_it(monkeypatch):
    monkeypatch.setenv("BRISK_DECODE_STACK", "maybe")
    with pytest.raises(BriskError, match="BRISK_DECODE_STACK='maybe'"):
        paths.compute_paths("cpu")


def test_the_choice_is_logged_once_and_again_when_it_changes(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="brisk.kernels")
    for _ in range(3):
        paths.compute_paths("cpu")
    monkeypatch.setenv("BRISK_MATMUL", "torch")
    paths.compute_paths("cpu")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compute paths")]
    assert len(lines) == 2 and "float matmuls F.linear" in lines[1] and "F.linear" not in lines[0]
