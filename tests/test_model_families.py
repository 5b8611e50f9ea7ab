"""Model families against transformers itself: tiny random-weight models built by transformers
(fp32, eager attention, prompts longer than any RoPE original context or sliding window) are
saved as HF directories and converted to GGUF by llama.cpp's own `convert_hf_to_gguf.py`; brisk
loads both and must give HF's logits (1e-4 relative) and HF's greedy tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from brisk.engine.sampling_params import SamplingParams
from brisk.errors import ModelLoadError
from brisk.llm import LLM
from brisk.loading.loader import load
from brisk.models.simple_cache import SingleSequenceCache

from llamacpp import convert_hf_to_gguf

PROMPT_LEN, NEW_TOKENS = 72, 24


def demo_tokenizer_files(demo, into: Path) -> None:
    """The demo's byte-level BPE tokenizer (llama.cpp's converter knows its pre-tokenizer)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo.model_dir / name, into / name)


def prompt_ids(vocab: int, n: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    hf.generation_config.eos_token_id = None  # run the full length, as brisk's ignore_eos does
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def brisk_logits(path: Path, ids: list[int]) -> torch.Tensor:
    loaded = load(str(path), max_model_len=256, warmup=False, quantization="none")
    cache = SingleSequenceCache(loaded.config, len(ids), torch.float32, "cpu")
    cache.begin(len(ids))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache))


def brisk_greedy(path: Path, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    llm = LLM(str(path), quantization="none", max_model_len=256, num_blocks=64)
    return llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, rtol=0, atol=1e-4)


# -- Llama 3.1+: llama3 RoPE, from rope_scaling (HF) and from rope_freqs.weight (GGUF) ------------
@pytest.fixture(scope="module")
def llama31(tmp_path_factory, demo, brisk_cache):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("llama31")
    cfg = LlamaConfig(vocab_size=demo.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32},
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(root / "hf")
    demo_tokenizer_files(demo, root / "hf")
    gguf = convert_hf_to_gguf(root / "hf", root / "llama31-f32.gguf")
    return hf, root / "hf", gguf


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_llama31_logits_and_greedy_tokens_match_hf(llama31, source):
    hf, hf_dir, gguf = llama31
    path = hf_dir if source == "hf" else gguf
    ids = prompt_ids(hf.config.vocab_size)
    assert_logits_close(brisk_logits(path, ids), hf_logits(hf, ids))
    assert brisk_greedy(path, ids) == hf_greedy(hf, ids)


def test_the_gguf_holds_its_rope_scaling_as_rope_freqs(llama31):
    """What made Llama 3.1 GGUFs silently wrong: the scaling lives in a tensor, not in metadata."""
    import gguf

    reader = gguf.GGUFReader(str(llama31[2]))
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}
    assert not any("rope.scaling" in key for key in reader.fields)


def test_a_gguf_tensor_brisk_would_not_read_is_refused(llama31, tmp_path, brisk_cache):
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(llama31[2]))
    path = tmp_path / "extra-tensor.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q_norm\.weight are not read"):
        load(str(path), warmup=False, quantization="none")
