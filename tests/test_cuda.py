"""brisk on a CUDA GPU, against the same references as on CPU: the KV cache's codec (every
--kv-cache-dtype) stores what the CPU's stores, gathered paged attention matches float64 attention
over the stored values, a Llama checkpoint's logits and greedy tokens match HF transformers' on the
same GPU, and every KV dtype serves the same greedy tokens alone, with its prefix cached, and in a
batch that preempts. Skipped without a GPU (CI has none, and `make test` installs the CPU torch).

On a machine with a CUDA torch: `BRISK_TEST_CUDA=1 pytest tests/test_cuda.py`. Without that variable
tests/conftest.py hides the GPUs (the other modules test the CPU paths, and `--device auto` would
pick a GPU), and this module skips. First run 2026-12-04 on an H200 (torch 2.11.0+cu130): 20 passed."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM

from kv_blocks import scattered
from test_kv_dtypes import float64_attention, hard_values, run_greedy
from brisk.engine.attention import PagedKVCache, TorchPagedAttention, attention_backend, block_tables
from brisk.engine.model_runner import SeqSlice, build_batch
from brisk.kv_dtype import DTYPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU, and BRISK_TEST_CUDA=1 (tests/conftest.py hides GPUs)")

CPU, GPU = torch.device("cpu"), torch.device("cuda")
VOCAB = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A float32 Llama with GQA (8 query heads, 2 KV heads, head_dim 32) and random weights."""
    path = tmp_path_factory.mktemp("llama-cuda")
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("kv", list(DTYPES.values()), ids=lambda d: d.name)
def test_the_gpu_cache_holds_what_the_cpu_cache_holds(kv):
    """The same floats (every binade, fp8/fp16 ties, values past each format's range) stored at
    scattered slots: the GPU's codec (torch) and the CPU's (the compiled store) keep the same codes,
    and int8 the same scales."""
    values = hard_values(4000, 1)
    n = values.numel() // 64
    k = values[:n * 64].view(n, 2, 32)
    v = k.flip(0)
    slots = torch.randperm(n + 40, generator=torch.Generator().manual_seed(2))[:n]
    caches = {}
    for device in (CPU, GPU):
        cache = PagedKVCache(1, n + 40, 2, 32, kv, device, huge_pages=False)
        cache.store(0, k.to(device), v.to(device), slots.to(device))
        caches[device] = cache
    assert torch.equal(caches[GPU].k[0].cpu()[slots], caches[CPU].k[0][slots]), kv.name
    assert torch.equal(caches[GPU].v[0].cpu()[slots], caches[CPU].v[0][slots]), kv.name
    for cpu_scale, gpu_scale in zip(caches[CPU].scales(0), caches[GPU].scales(0)):
        if cpu_scale is not None:
            assert torch.equal(gpu_scale.cpu()[slots], cpu_scale[slots]), kv.name
    for got, want in zip(caches[GPU].gather(0, slots.to(GPU), torch.float32), caches[CPU].gather(0, slots, torch.float32)):
        assert torch.equal(got.cpu(), want), kv.name


@pytest.mark.parametrize("kv", list(DTYPES.values()), ids=lambda d: d.name)
def test_gathered_attention_on_the_gpu_matches_float64(kv):
    """Decode rows of ragged lengths over scattered blocks, and a prompt chunk after a cached
    prefix, through the attention the engine picks on a GPU: each writes its new K/V into the pool
    in `kv`, then attends; against float64 attention over exactly what the pool then holds."""
    assert attention_backend(GPU) is TorchPagedAttention
    bs, heads, kv_heads, dim, scale = 8, 8, 2, 32, 0.17
    lengths = [1, 9, 300, 1100]
    prompt_start, prompt_len = 40, 24
    num_blocks = sum(-(-n // bs) for n in lengths) + -(-(prompt_start + prompt_len) // bs) + 1
    tables = scattered(lengths + [prompt_start + prompt_len], bs, num_blocks, 5, spare=False)
    gen = torch.Generator().manual_seed(6)
    cache = PagedKVCache(1, num_blocks * bs, kv_heads, dim, kv, GPU, huge_pages=False)
    everything = torch.arange(num_blocks * bs, device=GPU)
    cache.store(0, *torch.randn(2, num_blocks * bs, kv_heads, dim, generator=gen).to(GPU), everything)
    seqs = [SeqSlice([0], n - 1, table, True) for n, table in zip(lengths, tables)]
    seqs.append(SeqSlice([0] * prompt_len, prompt_start, tables[-1], False))
    batch = build_batch(seqs, bs, GPU)
    rows = len(lengths) + prompt_len
    q, k, v = (torch.randn(rows, h, dim, generator=gen).to(GPU) for h in (heads, kv_heads, kv_heads))
    out = TorchPagedAttention(cache, batch.meta, scale)(0, q, k, v)
    keys, values = (t.cpu() for t in cache.gather(0, everything, torch.float64))
    row_tables = block_tables([tables[i] for i in range(len(lengths))] + [tables[-1]] * prompt_len,
                              lengths + list(range(prompt_start + 1, prompt_start + prompt_len + 1)), bs)
    row_lengths = torch.tensor(lengths + list(range(prompt_start + 1, prompt_start + prompt_len + 1)))
    want = float64_attention(q.cpu(), keys, values, row_tables, row_lengths, bs, scale)
    assert (out.cpu().double() - want).abs().max().item() < 1e-4, kv.name


def _hf(path):
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(GPU).eval()


def test_float32_logits_and_greedy_tokens_match_hf_on_the_gpu(checkpoint):
    from brisk.config import CacheConfig
    from brisk.engine.engine import LLMEngine
    from brisk.engine.scheduler import SchedulerConfig
    from brisk.loading.loader import load
    from brisk.models.simple_cache import SingleSequenceCache

    loaded = load(str(checkpoint), device="cuda", dtype="float32", warmup=False)
    assert loaded.device.type == "cuda" and loaded.dtype == torch.float32
    ids = [random.Random(1).randrange(VOCAB) for _ in range(40)]
    cache = SingleSequenceCache(loaded.config, len(ids), torch.float32, GPU)
    cache.begin(len(ids))
    hf = _hf(checkpoint)
    with torch.inference_mode():
        got = loaded.model.compute_logits(loaded.model(torch.tensor(ids, device=GPU), torch.arange(len(ids), device=GPU),
                                                       cache))
        want = hf(torch.tensor([ids], device=GPU)).logits[0]
        hf_tokens = hf.generate(torch.tensor([ids], device=GPU), max_new_tokens=24, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=GPU),
                                pad_token_id=0)[0, len(ids):].tolist()
    assert (got.float() - want).abs().max().item() < 1e-3
    engine = LLMEngine(loaded, CacheConfig(block_size=8, num_gpu_blocks_override=64, kv_cache_dtype="float32"),
                       SchedulerConfig(max_model_len=256))
    assert run_greedy(engine, [ids], max_tokens=24)[0] == hf_tokens


def test_auto_on_the_gpu_computes_in_16_bits_and_keeps_hfs_top_tokens(checkpoint):
    from brisk.loading.loader import load
    from brisk.models.simple_cache import SingleSequenceCache

    loaded = load(str(checkpoint), device="cuda", warmup=False)
    assert loaded.dtype in (torch.bfloat16, torch.float16)
    ids = [random.Random(2).randrange(VOCAB) for _ in range(40)]
    cache = SingleSequenceCache(loaded.config, len(ids), loaded.dtype, GPU)
    cache.begin(len(ids))
    with torch.inference_mode():
        got = loaded.model.compute_logits(loaded.model(torch.tensor(ids, device=GPU), torch.arange(len(ids), device=GPU),
                                                       cache)).float()
        want = _hf(checkpoint)(torch.tensor([ids], device=GPU)).logits[0]
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item() > 0.99


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_kv_dtype_serves_the_same_greedy_tokens_on_the_gpu(checkpoint, name):
    """As tests/test_kv_dtypes.py's CPU test: one KV dtype per pool on the GPU, a greedy request
    alone, again with its prefix cached, and inside a batch that overflows a small pool."""
    from brisk.config import CacheConfig
    from brisk.engine.engine import LLMEngine
    from brisk.engine.scheduler import SchedulerConfig
    from brisk.loading.loader import load

    loaded = load(str(checkpoint), device="cuda", dtype="float32", warmup=False)

    def engine(num_blocks: int) -> LLMEngine:
        return LLMEngine(loaded, CacheConfig(block_size=8, num_gpu_blocks_override=num_blocks, kv_cache_dtype=name),
                         SchedulerConfig(max_model_len=256))

    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(48)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(96)] for _ in range(6)]
    roomy = engine(256)
    assert roomy.kv_dtype.name == DTYPES[name].name and roomy.runner.kv.k.device.type == "cuda"
    alone = run_greedy(roomy, prompts[:1])[0]
    cached = run_greedy(roomy, prompts[:1])[0]
    assert roomy.kv.prefix_hits_tokens == 136
    tight = engine(36)
    batched = run_greedy(tight, prompts)
    assert tight.scheduler.num_preemptions > 0
    assert alone == cached == batched[0], name
    assert len({tuple(t) for t in batched}) > 1
