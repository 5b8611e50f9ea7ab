"""Sliding-window attention (Mistral's `sliding_window`, Qwen2's `use_sliding_window` +
`max_window_layers`, `layer_types`, GGUF's `attention.sliding_window`): configs read as
transformers reads them, logits equal to transformers' on sequences of 3x the window (simple path
and the paged engine, kernel and torch attention), the block bound while a long sequence decodes,
and prefix caching with a window."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from brisk.config import CacheConfig, ModelConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.kv_cache.manager import WINDOW_FREED
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import SchedulerConfig
from brisk.errors import ModelLoadError
from brisk.loading.gguf_header import hf_config
from brisk.loading.loader import load

VOCAB = 256
WINDOW = 16
SEQ_LEN = 3 * WINDOW


def _tiny(cls_config, **overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    kwargs.update(overrides)
    return cls_config(**kwargs)


def _save(model, path):
    model.save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = MistralForCausalLM(_tiny(MistralConfig, sliding_window=WINDOW)).eval()
    return _save(model, tmp_path_factory.mktemp("mistral-swa")), model


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """Qwen2 with a per-layer mix: layer 0 full attention, layer 1 windowed (max_window_layers=1)."""
    torch.manual_seed(1)
    config = _tiny(Qwen2Config, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    model = Qwen2ForCausalLM(config).eval()
    return _save(model, tmp_path_factory.mktemp("qwen2-swa")), model


# -- configs ----------------------------------------------------------------------
def _cfg(d):
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 3,
            "num_attention_heads": 2}
    return ModelConfig.from_hf_dict({**base, **d})


def test_windows_are_read_as_transformers_reads_them():
    assert _cfg({"model_type": "mistral", "sliding_window": 16}).layer_windows == (16, 16, 16)
    assert _cfg({"model_type": "mistral"}).layer_windows == (4096,) * 3  # MistralConfig's default
    assert _cfg({"model_type": "mistral", "sliding_window": None}).layer_windows == ()
    assert _cfg({"model_type": "qwen2", "sliding_window": 16}).layer_windows == ()  # use_sliding_window off
    qwen = _cfg({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})
    assert qwen.layer_windows == (None, 16, 16) and qwen.kv_window is None  # full layer 0 keeps every block
    types = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    assert _cfg(types).layer_windows == (8, None, 8)
    assert _cfg({"model_type": "llama"}).layer_windows == () and _cfg({"model_type": "llama"}).kv_window is None
    assert _cfg({"model_type": "mistral", "sliding_window": 16}).kv_window == 16


@pytest.mark.parametrize("d,needle", [
    ({"model_type": "llama", "layer_types": ["chunked_attention"] * 3, "sliding_window": 4}, "chunked_attention"),
    ({"model_type": "llama", "layer_types": ["sliding_attention"]}, "one type per layer (3)"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive integer"),
])
def test_bad_window_configs_are_refused(d, needle):
    with pytest.raises(ModelLoadError) as e:
        _cfg(d)
    assert needle in str(e.value)


def test_hf_configs_saved_by_transformers(mistral_dir, qwen2_dir):
    for (path, _), expected in ((mistral_dir, (WINDOW, WINDOW)), (qwen2_dir, (None, WINDOW))):
        cfg = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        assert cfg.layer_windows == expected


def test_gguf_sliding_window_key():
    meta = {"general.architecture": "llama", "llama.attention.head_count": 2, "llama.embedding_length": 8,
            "llama.vocab_size": 10, "llama.feed_forward_length": 8, "llama.block_count": 2,
            "llama.attention.sliding_window": 32}
    assert ModelConfig.from_hf_dict(hf_config(meta, True, "m.gguf")).layer_windows == (32, 32)
    del meta["llama.attention.sliding_window"]
    assert ModelConfig.from_hf_dict(hf_config(meta, True, "m.gguf")).layer_windows == ()


# -- logits against transformers ------------------------------------------------------
def _hf_logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("which", ["mistral", "qwen2"])
def test_simple_path_logits_match_transformers(which, mistral_dir, qwen2_dir):
    from brisk.models.simple_cache import SingleSequenceCache

    path, model = mistral_dir if which == "mistral" else qwen2_dir
    ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    loaded = load(str(path), max_model_len=256, warmup=False)
    cache = SingleSequenceCache(loaded.config, SEQ_LEN, torch.float32, "cpu")
    with torch.inference_mode():
        cache.begin(SEQ_LEN - 8)  # a prompt, then the rest in a second chunk and one by one
        first = loaded.model(torch.tensor(ids[:SEQ_LEN - 8]), torch.arange(SEQ_LEN - 8), cache)
        cache.commit()
        rows = [first]
        for start in range(SEQ_LEN - 8, SEQ_LEN):
            cache.begin(1)
            rows.append(loaded.model(torch.tensor(ids[start:start + 1]), torch.tensor([start]), cache))
            cache.commit()
        ours = loaded.model.compute_logits(torch.cat(rows))
    hf = _hf_logits(model, ids)
    torch.testing.assert_close(ours, hf, rtol=1e-4, atol=1e-4)
    # and the window matters: full attention would give other logits past the window
    full = MistralForCausalLM if which == "mistral" else Qwen2ForCausalLM
    no_window = full(model.config.__class__(**{**model.config.to_dict(), "sliding_window": None,
                                                "use_sliding_window": False, "layer_types": None})).eval()
    no_window.load_state_dict(model.state_dict())
    assert (_hf_logits(no_window, ids)[WINDOW + 1:] - hf[WINDOW + 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("which", ["mistral", "qwen2"])
def test_paged_engine_matches_transformers_past_three_windows(which, attention, mistral_dir, qwen2_dir,
                                                               monkeypatch):
    """Greedy generation through the paged engine (blocks of 4, prompt chunks of 8, decode through
    the compiled kernel or the torch path) to 3x the window: every generated token and its
    logprob equal transformers' on the same growing sequence."""
    monkeypatch.setenv("BRISK_ATTENTION", attention)
    path, model = mistral_dir if which == "mistral" else qwen2_dir
    loaded = load(str(path), max_model_len=256, warmup=False)
    # float32 KV: the reference is transformers' float32 to 1e-4 (bf16 KV, this CPU's auto, moves
    # logprobs by ~2e-4; tests/test_kv_dtypes.py bounds each dtype against float32 KV)
    engine = LLMEngine(loaded, CacheConfig(block_size=4, num_gpu_blocks_override=128, kv_cache_dtype="float32"),
                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=256))
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=SEQ_LEN - 20 + 4, temperature=0, ignore_eos=True,
                                              logprobs=0))
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    ids = prompt + final.token_ids
    hf = torch.log_softmax(_hf_logits(model, ids[:-1]), dim=-1)[len(prompt) - 1:]
    assert final.token_ids == hf.argmax(dim=-1).tolist()
    ours = torch.tensor([lp["logprob"] for lp in final.logprobs])
    torch.testing.assert_close(ours, hf.gather(1, torch.tensor(final.token_ids)[:, None])[:, 0],
                               rtol=0, atol=1e-4)


# -- memory bound and prefix caching --------------------------------------------------
def test_a_long_generation_holds_at_most_window_blocks_plus_one(mistral_dir):
    path, _ = mistral_dir
    loaded = load(str(path), max_model_len=256, warmup=False)
    bs = 4
    engine = LLMEngine(loaded, CacheConfig(block_size=bs, num_gpu_blocks_override=64),
                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256))
    rid = engine.add_request(list(range(10)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        blocks = engine.kv.req_blocks.get(rid, [])
        held.append(sum(b is not WINDOW_FREED for b in blocks))
        if blocks:
            assert engine.stats().kv_blocks_used == held[-1]
    assert max(held) <= -(-WINDOW // bs) + 1 == 5
    assert len(held) > 150 and engine.stats().kv_blocks_used == 0  # (210 tokens would fill 53 blocks)


def test_prefix_caching_with_a_window_keeps_outputs(mistral_dir):
    path, _ = mistral_dir
    loaded = load(str(path), max_model_len=256, warmup=False)
    prompt = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(engine, n):
        outs = []
        for i in range(n):  # one after another: the second finds the first's blocks in the cache
            engine.add_request(prompt, params, request_id=f"r{i}")
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outs.append(out.token_ids)
        return outs

    cached = LLMEngine(loaded, CacheConfig(block_size=4, num_gpu_blocks_override=128),
                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256))
    plain = LLMEngine(loaded, CacheConfig(block_size=4, num_gpu_blocks_override=128, enable_prefix_caching=False),
                      SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256))
    got = run(cached, 2)
    assert got[0] == got[1] == run(plain, 1)[0]
    assert cached.stats().prefix_cache_hits_tokens == 44  # every full block of the prompt but the last token's
