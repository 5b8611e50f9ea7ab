"""The compiled paged decode attention (brisk/kernels/paged_attention.cpp) against a float64
reference that gathers each row's context out of the cache and runs SDPA on it: random block
tables from a shuffled pool, ragged lengths (1 token, block edges, thousands), GQA groups,
float32 and bfloat16 caches, odd block sizes, context split into parts or not, on every
instruction-set path this CPU can run."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from isa_paths import ATTENTION_PATHS, force_attention
from kv_blocks import scattered
from brisk.errors import BriskError
from brisk import kernels
from brisk.kv_dtype import FLOAT32
from brisk.models.layers import attend
from brisk.engine.attention import (AttentionMetadata, KernelPagedAttention, PagedKVCache, PrefillSeq,
                                    TorchPagedAttention, attention_backend, block_tables, context_slots)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lib():
    lib = kernels.library()
    assert lib is not None, "make builds brisk/kernels/_kernels.so; the kernel tests need it"
    yield lib
    lib.brisk_paged_attention_force_isa(-1)


def reference(q, k, v, tables, lengths, bs, scale):
    slots, mask = context_slots(tables, lengths, bs, CPU)
    n, _, d = q.shape
    kv_heads = k.shape[1]
    keys = k.double().index_select(0, slots).view(n, -1, kv_heads, d).transpose(1, 2)
    values = v.double().index_select(0, slots).view(n, -1, kv_heads, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.double().unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.reshape(n, -1)


def test_context_slots_expand_block_tables_like_the_per_token_reference():
    """The torch path expands block tables into slots with tensor ops; the reference is the slot
    of each position p: block_ids[p // block_size] * block_size + p % block_size."""
    bs = 16
    rng = random.Random(3)
    lengths = [rng.randint(1, 700) for _ in range(9)] + [bs * 4]  # ragged, and one on a block edge
    tables = scattered(lengths, bs, 400, seed=3)
    slots, mask = context_slots(block_tables(tables, lengths, bs), torch.tensor(lengths), bs, CPU)
    width = max(lengths)
    slots = slots.view(len(lengths), width)
    for row, (table, n) in enumerate(zip(tables, lengths)):
        assert slots[row, :n].tolist() == [table[p // bs] * bs + p % bs for p in range(n)]
        assert slots[row, n:].eq(0).all()  # padding reads slot 0 (finite), and the mask hides it
        assert mask[row, 0, 0].tolist() == [True] * n + [False] * (width - n)
    one, no_mask = context_slots(block_tables(tables[:1], lengths[:1], bs), torch.tensor(lengths[:1]), bs, CPU)
    assert no_mask is None and one.tolist() == slots[0, :lengths[0]].tolist()


ISAS = {k: v for k, v in ATTENTION_PATHS.items() if k <= 3}  # float32/bfloat16 run the same loops at 4


@pytest.mark.parametrize("isa", sorted(ISAS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [(9, 3, 64, 16), (8, 8, 128, 16), (32, 4, 64, 7), (4, 1, 80, 1)])
def test_kernel_matches_gathered_sdpa(lib, isa, dtype, heads, kv_heads, dim, bs):
    force_attention(lib, isa)
    rng = random.Random(heads * 1000 + bs)
    lengths = [1, bs, bs + 1, 3 * bs] + [rng.randint(1, 1200) for _ in range(6)]
    num_blocks = sum(-(-n // bs) + 1 for n in lengths) + 2
    gen = torch.Generator().manual_seed(bs)
    k = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    tables = block_tables(scattered(lengths, bs, num_blocks, seed=bs), lengths, bs)
    lens = torch.tensor(lengths, dtype=torch.int32)
    ref = reference(q, k, v, tables, lens, bs, dim ** -0.5)
    for part in (0, 64, 512):  # one part per row, and rows split into parts merged at the end
        out = kernels.paged_decode_attention(q, k, v, tables, lens, bs, dim ** -0.5, part_tokens=part)
        assert out is not None and out.dtype == torch.float32
        err = (out.double() - ref).abs().max().item()
        assert err < 2e-5, (ISAS[isa], part, err)


def test_kernel_reads_only_the_slots_its_block_tables_name(lib):
    """Every slot outside the rows' tables (and past each row's length inside its last block)
    holds NaN: one read of a wrong slot would turn the output NaN."""
    bs, heads, kv_heads, dim = 16, 6, 2, 64
    lengths = [5, 16, 33, 700, 1]
    num_blocks = 80
    tables = block_tables(scattered(lengths, bs, num_blocks, seed=1), lengths, bs)
    k = torch.full((num_blocks * bs, kv_heads, dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    for row, n in enumerate(lengths):
        slots = [int(tables[row, p // bs]) * bs + p % bs for p in range(n)]
        k[slots] = torch.randn(n, kv_heads, dim)
        v[slots] = torch.randn(n, kv_heads, dim)
    q = torch.randn(len(lengths), heads, dim)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = kernels.paged_decode_attention(q, k, v, tables, lens, bs, 0.125, part_tokens=64)
    assert torch.isfinite(out).all()
    clean = torch.nan_to_num(k), torch.nan_to_num(v)
    assert (out.double() - reference(q, *clean, tables, lens, bs, 0.125)).abs().max() < 2e-5


def test_one_row_is_the_same_in_any_batch(lib):
    """A row's result does not depend on the other rows (greedy batch invariance)."""
    bs, heads, kv_heads, dim = 16, 9, 3, 64
    lengths = [900, 13, 2000, 257]
    num_blocks = 260
    tables = block_tables(scattered(lengths, bs, num_blocks, seed=2), lengths, bs)
    k, v = torch.randn(2, num_blocks * bs, kv_heads, dim)
    q = torch.randn(len(lengths), heads, dim)
    lens = torch.tensor(lengths, dtype=torch.int32)
    batch = kernels.paged_decode_attention(q, k, v, tables, lens, bs, 0.125)
    for row in range(len(lengths)):
        alone = kernels.paged_decode_attention(q[row:row + 1], k, v, tables[row:row + 1, :-(-lengths[row] // bs)],
                                               lens[row:row + 1], bs, 0.125)
        assert torch.equal(alone[0], batch[row])


def test_shapes_the_kernel_does_not_take_fall_back_to_torch(lib):
    q = torch.randn(2, 4, 512)
    k = v = torch.randn(32, 2, 512)
    tables = torch.tensor([[1], [0]], dtype=torch.int32)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    assert kernels.paged_decode_attention(q, k, v, tables, lens, 16, 0.1) is None  # head_dim > 256
    assert kernels.paged_decode_attention(q[..., :64], k[..., :64].double(), v[..., :64].double(), tables, lens, 16,
                                          0.1) is None  # a cache of no KV dtype
    meta = AttentionMetadata(torch.tensor([0, 1]), 16, tables, lens, [])
    cache = PagedKVCache(1, 32, 2, 512, FLOAT32, CPU)
    cache.k.normal_()
    cache.v.normal_()
    knew = torch.randn(2, 2, 512)
    got = KernelPagedAttention(cache, meta, 0.1)(0, q, knew, knew)
    want = TorchPagedAttention(cache, meta, 0.1)(0, q, knew, knew)
    assert torch.equal(got, want)


def test_kernel_backend_matches_the_torch_backend_on_a_mixed_step(lib):
    """Decode rows and a prompt chunk over a cached prefix in one step, through the model-facing
    callable: writes this step's K/V, then attends (the prompt chunk takes SDPA on both)."""
    bs, heads, kv_heads, dim, blocks = 16, 9, 3, 64, 120
    decode_lens = [40, 300, 1]
    prefill_start, prefill_len = 50, 20
    lengths = decode_lens + [prefill_start + prefill_len]
    tables = scattered(lengths, bs, blocks, seed=5)
    outs = []
    for backend in (TorchPagedAttention, KernelPagedAttention):
        torch.manual_seed(0)
        cache = PagedKVCache(2, blocks * bs, kv_heads, dim, FLOAT32, CPU)
        cache.k.normal_()
        cache.v.normal_()
        new_slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(decode_lens)]
        new_slots += [tables[3][p // bs] * bs + p % bs for p in range(prefill_start, prefill_start + prefill_len)]
        ptable = block_tables(tables[3:], lengths[3:], bs)
        pslots, _ = context_slots(ptable, torch.tensor(lengths[3:]), bs, CPU)
        meta = AttentionMetadata(torch.tensor(new_slots), bs, block_tables(tables[:3], decode_lens, bs),
                                 torch.tensor(decode_lens, dtype=torch.int32),
                                 [PrefillSeq(3, prefill_len, pslots, prefill_start)])
        n = len(new_slots)
        q, k, v = torch.randn(3, n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
        attention = backend(cache, meta, dim ** -0.5)
        outs.append(torch.stack([attention(layer, q[layer], k, v) for layer in range(2)]))
    assert (outs[0] - outs[1]).abs().max() < 1e-5


def test_backend_choice(lib, monkeypatch):
    monkeypatch.delenv("BRISK_ATTENTION", raising=False)
    assert attention_backend(CPU) is KernelPagedAttention  # for every KV dtype: the kernel reads them all
    assert attention_backend(torch.device("cuda")) is TorchPagedAttention
    monkeypatch.setenv("BRISK_ATTENTION", "torch")
    assert attention_backend(CPU) is TorchPagedAttention
    monkeypatch.setenv("BRISK_ATTENTION", "fast")
    with pytest.raises(BriskError, match="BRISK_ATTENTION='fast': expected one of auto, torch"):
        attention_backend(CPU)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_sliding_window_reads_only_the_last_window_positions(lib, window):
    """With a window W each row attends to its last W positions: every slot before them holds NaN
    (as blocks freed out of the window may), and the kernel and the torch path both match a float64
    reference over exactly those positions."""
    bs, heads, kv_heads, dim = 4, 6, 2, 64
    lengths = [1, 3, 16, 17, 90, 700]
    num_blocks = 260
    tables = block_tables(scattered(lengths, bs, num_blocks, seed=window), lengths, bs)
    k = torch.full((num_blocks * bs, kv_heads, dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    k[0], v[0] = 0.0, 0.0  # slot 0 pads short rows of the torch path; PagedKVCache keeps it finite
    gen = torch.Generator().manual_seed(window)
    expected = []
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    for row, n in enumerate(lengths):
        seen = range(max(0, n - window), n)
        slots = [int(tables[row, p // bs]) * bs + p % bs for p in seen]
        k[slots] = torch.randn(len(slots), kv_heads, dim, generator=gen)
        v[slots] = torch.randn(len(slots), kv_heads, dim, generator=gen)
        keys = k[slots].double().transpose(0, 1).unsqueeze(0)  # [1, kv_heads, W, dim]
        values = v[slots].double().transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q[row].double()[None, :, None], keys, values, scale=0.125,
                                             enable_gqa=True)
        expected.append(out.reshape(-1))
    expected = torch.stack(expected)
    lens = torch.tensor(lengths, dtype=torch.int32)
    for part in (0, 64, 512):
        out = kernels.paged_decode_attention(q, k, v, tables, lens, bs, 0.125, part_tokens=part, window=window)
        assert (out.double() - expected).abs().max() < 2e-5, part
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), bs, tables, lens, [], (window,))
    cache = PagedKVCache(1, k.shape[0], kv_heads, dim, FLOAT32, CPU, huge_pages=False)
    cache.k[0], cache.v[0] = k, v
    torch_out = TorchPagedAttention(cache, meta, 0.125)._gathered_decode(q, 0, window)
    assert (torch_out.double() - expected).abs().max() < 2e-5


@pytest.mark.parametrize("isa", sorted(ISAS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37])
def test_prompt_rows_in_tiles_are_each_row_alone(lib, isa, dtype, window):
    """A prompt chunk's rows (one sequence's consecutive positions, one block table) walk their
    context together in tiles; each row's result is bit for bit the one it gets alone as a decode
    row, wherever the chunk starts (so a cached prefix changes nothing), across part boundaries
    and windows, and it matches the float64 reference."""
    force_attention(lib, isa)
    bs, heads, kv_heads, dim = 16, 8, 2, 64
    total = 1100  # the prompt; chunks of it below start at 0, mid-block and just before a part edge
    num_blocks = -(-total // bs) + 3
    table = scattered([total], bs, num_blocks, seed=7)[0]
    gen = torch.Generator().manual_seed(isa)
    k = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen).to(dtype)
    q_all = torch.randn(total, heads, dim, generator=gen)
    lens_all = torch.arange(1, total + 1, dtype=torch.int32)
    tables_all = block_tables([table] * total, lens_all.tolist(), bs)
    alone = torch.cat([kernels.paged_decode_attention(q_all[p:p + 1], k, v, tables_all[p:p + 1], lens_all[p:p + 1],
                                                      bs, 0.125, window=window) for p in range(total)])
    for start, end in ((0, 40), (5, 300), (505, 530), (1000, 1100)):
        # a decode row of another sequence first, as the runner lays a mixed step out
        other = scattered([50], bs, num_blocks, seed=8)[0]
        q = torch.cat([torch.randn(1, heads, dim, generator=gen), q_all[start:end]])
        lens = torch.cat([torch.tensor([50], dtype=torch.int32), lens_all[start:end]])
        tables = block_tables([other] + [table] * (end - start), lens.tolist(), bs)
        out = kernels.paged_decode_attention(q, k, v, tables, lens, bs, 0.125, window=window)
        assert torch.equal(out[1:], alone[start:end]), (ISAS[isa], start)
    if window is None:
        ref = reference(q_all[::97], k, v, tables_all[::97], lens_all[::97], bs, 0.125)
        assert (alone[::97].double() - ref).abs().max() < 2e-5


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_soft_capped_scores_match_the_eager_reference(lib, isa):
    """Gemma 2's soft-capping (cap * tanh(score / cap) before the softmax) in the kernel: against
    the eager float64 math transformers runs, with scores large enough that the cap bites."""
    force_attention(lib, isa)
    bs, heads, kv_heads, dim, cap = 16, 8, 4, 64, 5.0
    lengths = [1, 17, 300, 1030]
    num_blocks = sum(-(-n // bs) + 1 for n in lengths) + 2
    gen = torch.Generator().manual_seed(isa + 11)
    k = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen) * 3
    v = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen) * 3
    tables = block_tables(scattered(lengths, bs, num_blocks, seed=5), lengths, bs)
    lens = torch.tensor(lengths, dtype=torch.int32)
    slots, mask = context_slots(tables, lens, bs, CPU)
    keys = k.double().index_select(0, slots).view(len(lengths), -1, kv_heads, dim).transpose(1, 2)
    values = v.double().index_select(0, slots).view(len(lengths), -1, kv_heads, dim).transpose(1, 2)
    capped = attend(q.double().unsqueeze(2), keys, values, mask, False, 0.125, cap).reshape(len(lengths), -1)
    plain = reference(q, k, v, tables, lens, bs, 0.125)
    assert (capped - plain).abs().max() > 0.1  # the cap changes the result here
    for part in (0, 512):
        out = kernels.paged_decode_attention(q, k, v, tables, lens, bs, 0.125, part_tokens=part, softcap=cap)
        assert (out.double() - capped).abs().max() < 2e-5, (ISAS[isa], part)
