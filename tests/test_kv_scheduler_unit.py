"""Block pool, KV manager and scheduler at tiny sizes: exact block ids, ref counts,
hash hits, eviction order and preemption order. Pure Python, no model."""

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings, strategies as st

from brisk.engine.kv_cache.block_pool import BlockPool
from brisk.engine.kv_cache.manager import KVCacheManager
from brisk.engine.request import Request, RequestStatus
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import Scheduler, SchedulerConfig


@dataclass
class Req:
    request_id: str
    tokens: list = field(default_factory=list)
    cache_salt: str | None = None

    @property
    def all_token_ids(self):
        return self.tokens


def test_pool_allocates_in_order_and_refuses_when_full():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.allocate(2) is None and pool.num_free_blocks == 1
    pool.free(list(reversed(a)))
    assert list(pool.free_blocks) == [3, 2, 1, 0]  # freed tail-first joins the queue tail
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([a[0]])


def test_manager_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = Req("a", list(range(10)))  # blocks: [0-3] [4-7] [8,9]
    assert kv.allocate_slots(a, 10, kv.find_cached_prefix(a)) is not None
    assert kv.block_ids("a") == [0, 1, 2]
    kv.cache_full_blocks(a, 10)
    b = Req("b", list(range(8)) + [99, 98, 97])
    hit = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1] and hit.num_tokens == 8
    kv.allocate_slots(b, 3, hit)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert (kv.prefix_queries_tokens, kv.prefix_hits_tokens) == (21, 8)


def test_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = Req("a", list(range(8)))
    kv.allocate_slots(a, 8, kv.find_cached_prefix(a))
    kv.cache_full_blocks(a, 8)
    hit = kv.find_cached_prefix(Req("b", list(range(8))))
    assert hit.num_tokens == 4  # not 8: the last token's logits are needed


def test_salt_separates_prefixes():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = Req("a", list(range(9)), cache_salt="tenant-1")
    kv.allocate_slots(a, 9, kv.find_cached_prefix(a))
    kv.cache_full_blocks(a, 9)
    assert kv.find_cached_prefix(Req("b", list(range(9)), cache_salt="tenant-2")).num_tokens == 0
    assert kv.find_cached_prefix(Req("c", list(range(9)), cache_salt="tenant-1")).num_tokens == 8


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    a = Req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5, kv.find_cached_prefix(a))
    assert kv.block_ids("a") == [0, 1, 2]
    kv.cache_full_blocks(a, 5)  # blocks 0 and 1 are full and get hashes; 2 is partial
    kv.free("a")
    assert list(kv.pool.free_blocks) == [3, 4, 2, 1, 0] and kv.pool.num_cached_free_blocks == 2
    b = Req("b", [1, 2, 3, 4, 9])
    hit = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]  # revived from the free queue
    assert kv.allocate_slots(b, 1, hit) is not None
    assert kv.block_ids("b") == [0, 1, 3]
    c = Req("c", [7, 7, 7])
    assert kv.allocate_slots(c, 3, kv.find_cached_prefix(c)) is not None
    assert kv.block_ids("c") == [4, 2]
    d = Req("d", [5])
    assert kv.allocate_slots(d, 1, kv.find_cached_prefix(d)) is None  # pool exhausted
    kv.free("b")  # tail first: 3, then the prefix's tail 1, then its head 0
    assert list(kv.pool.free_blocks) == [3, 1, 0]
    e = Req("e", [8, 8, 8])
    kv.allocate_slots(e, 3, kv.find_cached_prefix(e))
    assert kv.block_ids("e") == [3, 1] and kv.pool.num_evictions == 1  # LRU: block 1 evicted, 0 kept
    f = Req("f", [1, 2, 6])
    assert [blk.block_id for blk in kv.find_cached_prefix(f).blocks] == [0]


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = Req("a", list(range(8)))
    assert kv.allocate_slots(a, 8, kv.find_cached_prefix(a)) is not None
    before = (kv.num_free_blocks, kv.block_ids("a"))
    assert kv.allocate_slots(a, 1) is None
    assert (kv.num_free_blocks, kv.block_ids("a")) == before


def test_usage_and_internal_fragmentation():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = Req("a", list(range(5)))
    kv.allocate_slots(a, 5, kv.find_cached_prefix(a))
    usage = kv.usage()
    assert usage.num_used_blocks == 2 and usage.num_used_slots == 5
    assert usage.internal_fragmentation == pytest.approx(3 / 8) and usage.usage == pytest.approx(0.2)
    kv.cache_full_blocks(a, 5)
    b = Req("b", list(range(4)) + [50, 51, 52])  # shares a's first (full) block
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 4
    kv.allocate_slots(b, 3, hit)
    usage = kv.usage()
    # blocks: a0 (shared, 4 slots, counted once), a1 (1 slot), b1 (3 slots)
    assert usage.num_used_blocks == 3 and usage.num_used_slots == 4 + 1 + 3


def _request(rid, n, max_tokens=4, priority=0):
    return Request(rid, list(range(100 * int(rid[1:]), 100 * int(rid[1:]) + n)),
                   SamplingParams(max_tokens=max_tokens), priority=priority)


def test_a_request_keeps_one_token_list():
    """Prompt and output live in one list that grows in place: reading the sequence (the KV
    manager's hashes, the runner's new tokens, the penalties) copies nothing per step, and the
    caller's prompt list is never appended to."""
    prompt = [5, 6, 7]
    req = Request("r1", prompt, SamplingParams(max_tokens=4))
    tokens = req.all_token_ids
    req.append_output(8)
    req.append_output(9)
    assert req.all_token_ids is tokens and tokens == [5, 6, 7, 8, 9]
    assert prompt == [5, 6, 7] and tokens is not prompt
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 2, 5)
    assert req.prompt_token_ids == [5, 6, 7] and req.output_token_ids == (8, 9)
    assert req.output_tokens_from(1) == [9]
    with pytest.raises(AttributeError):  # the output view is read-only: appends go through append_output
        req.output_token_ids.append(10)


def _finish_step(sched, out, token=7):
    """Pretend the model ran: advance and give each sampling request one token."""
    for req in sched.advance(out):
        req.append_output(token)
        if req.num_output_tokens >= req.params.max_tokens:
            sched.finish(req, RequestStatus.FINISHED_LENGTH)


def test_chunked_prefill_runs_decodes_first():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), KVCacheManager(32, 4))
    sched.add_request(_request("r1", 3))
    out = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r1", 3)]
    _finish_step(sched, out)
    sched.add_request(_request("r2", 20))
    out = sched.schedule()  # r1 decodes (1 token), r2 gets the remaining 7
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r1", 1), ("r2", 7)]
    _finish_step(sched, out)
    out = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r1", 1), ("r2", 7)]


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(3, 4))
    for rid in ("r1", "r2", "r3"):
        sched.add_request(_request(rid, 4, max_tokens=8))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r1", "r2", "r3"]
    _finish_step(sched, out)  # each now needs a 2nd block for its 5th token
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["r3", "r2"]
    assert [c.request.request_id for c in out.chunks] == ["r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    assert sched.requests["r3"].status == RequestStatus.PREEMPTED and sched.requests["r3"].num_computed_tokens == 0


def test_requests_admitted_in_one_step_share_a_prefix_computed_in_that_step():
    kv = KVCacheManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    shared = list(range(100, 109))  # two full blocks of 4, then one token
    sched.add_request(Request("a", shared + [1, 2], SamplingParams(max_tokens=2)))
    sched.add_request(Request("b", shared + [3], SamplingParams(max_tokens=2)))
    out = sched.schedule()
    # b reuses a's first two blocks although a computes them in this very step
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 11), ("b", 2)]
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert sched.requests["b"].num_cached_prompt_tokens == 8
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("a")[:2]] == [2, 2]


def test_priority_then_fcfs():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), KVCacheManager(16, 4))
    sched.add_request(_request("r1", 2, priority=1))
    sched.add_request(_request("r2", 2, priority=0))
    sched.add_request(_request("r3", 2, priority=0))
    assert [r.request_id for r in sched.waiting] == ["r2", "r3", "r1"]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_workload_never_leaks_or_loses_requests(data):
    """~1,000 random requests (random lengths, shared prefixes, aborts) through scheduler +
    manager: every request ends exactly once and every block is free at the end."""
    num_blocks = data.draw(st.integers(8, 40))
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=data.draw(st.booleans()))
    max_len = num_blocks * block_size
    sched = Scheduler(SchedulerConfig(max_num_seqs=data.draw(st.integers(1, 8)),
                                      max_num_batched_tokens=data.draw(st.integers(1, 64)),
                                      max_model_len=max_len), kv)
    prefixes = [[9000 + i] * data.draw(st.integers(0, 12)) for i in range(3)]
    rng = data.draw(st.randoms(use_true_random=False))
    submitted, ended = set(), []
    for i in range(40):
        plen = rng.randint(1, max(1, max_len // 3))
        tokens = (rng.choice(prefixes) + [rng.randint(0, 50) for _ in range(plen)])[: max_len - 1]
        req = Request(f"q{i}", tokens, SamplingParams(max_tokens=rng.randint(1, max(1, max_len - len(tokens)))))
        sched.add_request(req)
        submitted.add(req.request_id)
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.1 and sched.requests:
                victim = rng.choice(sorted(sched.requests))
                ended.append(sched.abort(victim).request_id)
            out = sched.schedule()
            assert out.chunks or not sched.has_unfinished, "no progress: deadlock"
            for req2 in sched.advance(out):
                req2.append_output(rng.randint(0, 50))
                if req2.num_output_tokens >= req2.params.max_tokens or req2.num_tokens >= max_len:
                    sched.finish(req2, RequestStatus.FINISHED_LENGTH)
                    ended.append(req2.request_id)
    for _ in range(20000):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        assert out.chunks, "no progress: deadlock"
        for req2 in sched.advance(out):
            req2.append_output(1)
            if req2.num_output_tokens >= req2.params.max_tokens or req2.num_tokens >= max_len:
                sched.finish(req2, RequestStatus.FINISHED_LENGTH)
                ended.append(req2.request_id)
    assert not sched.has_unfinished
    assert sorted(ended) == sorted(submitted) and len(ended) == len(set(ended))
    assert kv.num_free_blocks == num_blocks and not kv.req_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_scheduler_and_kv_cache_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, brisk.engine.scheduler, brisk.engine.kv_cache.manager; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_kv_sizing_and_refusal():
    from brisk.config import CacheConfig, parse_memory
    from brisk.errors import BriskError

    assert parse_memory("2GiB") == 2 * 2**30 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError, match="not understood"):
        parse_memory("lots")
    per_token = 46080  # SmolLM2-135M fp32: 2 * 30 layers * 192 * 4 bytes
    cfg = CacheConfig(block_size=16, kv_cache_memory=2 * 2**30)
    assert cfg.num_blocks(per_token, 8192, available_bytes=0) == 2 * 2**30 // (16 * per_token)
    with pytest.raises(BriskError, match="cannot hold one max-length sequence.*raise --kv-cache-memory to at least 360MiB"):
        CacheConfig(kv_cache_memory=100 * 2**20).num_blocks(per_token, 8192, available_bytes=0)
