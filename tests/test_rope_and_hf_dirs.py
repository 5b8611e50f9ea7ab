"""RoPE scaling and the Hugging Face directory path, against transformers itself.

Tiny random models are built and saved by transformers (sharded safetensors, an
index file, tied and untied embeddings, Qwen2's qkv bias); brisk loads the saved
directory and must produce the same logits.
"""

import json

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from brisk.config import ModelConfig
from brisk.loading.loader import load
from brisk.models.layers import rope_inv_freq

VOCAB = 256
ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 16},
}
SEQ_LEN = 48  # longer than max_position_embeddings, so dynamic NTK scaling is active


def _hf_config(rope: dict, cls=LlamaConfig, **overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  rope_parameters=dict(rope), tie_word_embeddings=False)
    kwargs.update(overrides)
    return cls(**kwargs)


def _save(model, path):
    model.save_pretrained(path, max_shard_size="100KB")  # several shards + index
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


def _brisk_logits(path, ids, max_model_len):
    loaded = load(str(path), max_model_len=max_model_len, warmup=False)
    from brisk.models.simple_cache import SingleSequenceCache

    cache = SingleSequenceCache(loaded.config, len(ids), torch.float32, "cpu")
    cache.begin(len(ids))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache)
        return loaded.model.compute_logits(hidden), loaded


def _hf_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_matches_hf_rope_functions(case):
    hf_cfg = _hf_config(ROPE_CASES[case])
    cfg = ModelConfig.from_hf_dict(json.loads(hf_cfg.to_json_string()))
    init = ROPE_INIT_FUNCTIONS.get(ROPE_CASES[case]["rope_type"])
    if init is None:  # "default" lives on the model class in transformers 5
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        init = LlamaRotaryEmbedding.compute_default_rope_parameters
    for seq_len in (None, SEQ_LEN):
        expected, expected_scale = init(hf_cfg, "cpu", seq_len=seq_len) if case != "default" else init(hf_cfg)
        actual, scale = rope_inv_freq(cfg, seq_len=seq_len)
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
        assert scale == pytest.approx(expected_scale)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_llama_dir_logits_match_hf(case, tmp_path, brisk_cache):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(_hf_config(ROPE_CASES[case])).eval()
    path = _save(hf, tmp_path)
    assert (path / "model.safetensors.index.json").exists()
    ids = torch.randint(0, VOCAB, (SEQ_LEN,)).tolist()
    logits, _ = _brisk_logits(path, ids, max_model_len=SEQ_LEN)
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_qwen2_dir_with_qkv_bias_and_tied_embeddings(tmp_path, brisk_cache):
    torch.manual_seed(1)
    cfg = _hf_config(ROPE_CASES["default"], cls=Qwen2Config, tie_word_embeddings=True)
    hf = Qwen2ForCausalLM(cfg).eval()
    for layer in hf.model.layers:  # random biases so the test can see them
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    path = _save(hf, tmp_path)
    ids = torch.randint(0, VOCAB, (20,)).tolist()
    logits, loaded = _brisk_logits(path, ids, max_model_len=32)
    assert loaded.config.qkv_bias and loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_hf_dir_weights_are_zero_copy_views_of_the_file(tmp_path, brisk_cache):
    """Unfused tensors are not copied: their storage lies inside the file's memory map."""
    torch.manual_seed(2)
    path = _save(LlamaForCausalLM(_hf_config(ROPE_CASES["default"])).eval(), tmp_path)
    loaded = load(str(path), warmup=False)
    maps = [(m.mm, len(m.mm)) for m in loaded.mapped_files]
    import ctypes

    bases = [ctypes.addressof(ctypes.c_char.from_buffer(mm)) for mm, _ in maps]

    def inside_a_map(t):
        ptr = t.data_ptr()
        return any(base <= ptr < base + size for base, (_, size) in zip(bases, maps))

    layer = loaded.model.model.layers[0]
    assert inside_a_map(layer.self_attn.o_proj.weight)
    assert inside_a_map(layer.mlp.down_proj.weight)
    assert inside_a_map(loaded.model.model.embed_tokens.weight)


def test_old_style_rope_scaling_keys_are_read():
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    })
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 5e5, 4.0)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4
