"""Every bad-input path of model loading: one clear error naming the file and what to do."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM

from brisk.errors import CacheDirError, ModelLoadError
from brisk.loading import gguf_convert
from brisk.loading.loader import load

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny_dir(tmp_path, brisk_cache):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(
        str(tmp_path / "tiny" / "tokenizer.json"))
    return tmp_path / "tiny"


def write_tiny_gguf(path: Path, tensor_type=gguf.GGMLQuantizationType.F32, tokenizer_model="gpt2",
                    arch="llama"):
    """A one-layer GGUF written with the gguf package's own writer."""
    w = gguf.GGUFWriter(str(path), arch)
    hidden, ffn, vocab = 32, 64, 8
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (16, hidden),
              "blk.0.attn_v.weight": (16, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if name == "token_embd.weight" and tensor_type != gguf.GGMLQuantizationType.F32:
            _, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]  # one block per row (byte shape)
            w.add_tensor(name, np.zeros((vocab, block_bytes), dtype=np.uint8), raw_dtype=tensor_type)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_path():
    with pytest.raises(ModelLoadError, match="not found.*catalog"):
        load("/no/such/model")


def test_directory_without_config(tmp_path, brisk_cache):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path, brisk_cache):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"x" * 10)
    with pytest.raises(ModelLoadError, match="unsupported model file"):
        load(str(path))
    path = tmp_path / "pytorch_model.bin"  # a checkpoint's weights alone: the hint names the directory
    path.write_bytes(b"x" * 10)
    with pytest.raises(ModelLoadError, match="a weights file alone is not a model; pass its directory"):
        load(str(path))


def test_truncated_safetensors(tiny_dir):
    weights = tiny_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="model.safetensors.*truncated or corrupt"):
        load(str(tiny_dir), warmup=False)


def test_corrupt_safetensors_header(tiny_dir):
    weights = tiny_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:20] = b"not json!!!!"
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt safetensors header"):
        load(str(tiny_dir), warmup=False)


def test_config_missing_required_keys(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    del cfg["hidden_size"], cfg["num_hidden_layers"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="config.json: missing required key.*hidden_size.*num_hidden_layers"):
        load(str(tiny_dir), warmup=False)


def test_unsupported_architecture(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        load(str(tiny_dir), warmup=False)


def test_weights_not_matching_config(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="do not match config.json"):
        load(str(tiny_dir), warmup=False)


def test_truncated_gguf(tmp_path, brisk_cache, demo_gguf_path):
    path = tmp_path / "cut.gguf"
    with open(demo_gguf_path, "rb") as f:
        path.write_bytes(f.read(3 << 20))
    with pytest.raises(ModelLoadError, match="cut.gguf: its tensors run .* past the end of the file; it is truncated"):
        load(str(path))


def test_corrupt_gguf_magic(tmp_path, brisk_cache):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="bad.gguf: not a GGUF file"):
        load(str(path))


def test_unsupported_quantization_type(tmp_path, brisk_cache):
    path = write_tiny_gguf(tmp_path / "iq2.gguf", tensor_type=gguf.GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(ModelLoadError, match=r"tensor token_embd\.weight uses quantization IQ2_XXS, which brisk can "
                                             r"neither run nor dequantize .*re-quantize the model"):
        load(str(path))


def test_unsupported_gguf_architecture(tmp_path, brisk_cache):
    path = write_tiny_gguf(tmp_path / "arch.gguf", arch="falcon")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'falcon'"):
        load(str(path))


def test_unsupported_gguf_tokenizer(tmp_path, brisk_cache):
    path = write_tiny_gguf(tmp_path / "bert.gguf", tokenizer_model="bert")
    with pytest.raises(ModelLoadError, match=r"bert\.gguf: GGUF tokenizer type 'bert' .* is not supported"):
        load(str(path))


def test_tiny_gguf_converts_and_runs(tmp_path, brisk_cache):
    loaded = load(str(write_tiny_gguf(tmp_path / "ok.gguf")))
    assert loaded.report.conversion_cache == "miss"
    assert loaded.config.num_layers == 1 and loaded.config.num_kv_heads == 1


def test_unwritable_cache_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("BRISK_CACHE", str(blocker / "cache"))
    with pytest.raises(CacheDirError, match=f"cache directory {blocker}/cache is not writable.*set BRISK_CACHE"):
        load()


def test_failed_conversion_leaves_nothing_in_the_cache(tmp_path, monkeypatch, demo_gguf_path):
    monkeypatch.setenv("BRISK_CACHE", str(tmp_path / "cache"))
    calls = {"n": 0}
    real = gguf_convert._repack_legacy  # the demo's Q4_1 tensors are repacked, not dequantized

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError("disk full (simulated)")
        return real(*args)

    monkeypatch.setattr(gguf_convert, "_repack_legacy", failing)
    with pytest.raises(OSError, match="simulated"):
        load()
    assert calls["n"] == 20
    assert list((tmp_path / "cache" / "converted").iterdir()) == []


def _cli(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "brisk", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def test_cli_error_is_one_line_with_exit_code_2(brisk_cache):
    result = _cli("generate", "--model", "/no/such/model", "hello")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("brisk: error: model '/no/such/model' not found")
    assert "Traceback" not in result.stderr


def test_cli_verbose_error_shows_traceback(brisk_cache):
    result = _cli("generate", "--model", "/no/such/model", "--verbose", "hello")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "brisk: error:" in result.stderr


def test_cli_unwritable_cache(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    result = _cli("generate", "hello", env_extra={"BRISK_CACHE": str(blocker / "c")})
    assert result.returncode == 2
    assert "is not writable" in result.stderr and "BRISK_CACHE" in result.stderr
    assert "Traceback" not in result.stderr
