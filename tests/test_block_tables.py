"""Persistent decode block tables (brisk.engine.block_table) against tables built from scratch
from the KV manager's block lists, through admit / grow / preempt / finish / abort / truncate
sequences of the real scheduler and KV manager. No model."""

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from brisk.engine.block_table import PersistentBlockTables
from brisk.engine.kv_cache.manager import KVCacheManager
from brisk.engine.model_runner import SeqSlice, build_batch
from brisk.engine.request import Request, RequestStatus
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import Scheduler, SchedulerConfig


def test_rows_are_written_once_grown_cut_back_and_released_exactly():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    tables = PersistentBlockTables(max_blocks_per_seq=2, capacity=1)
    a, b = Request("a", [1, 2, 3], SamplingParams()), Request("b", [4, 5], SamplingParams())
    kv.allocate_slots(a, 3, kv.find_cached_prefix(a))  # blocks 0, 1
    assert tables.update("a", kv.live_block_ids("a")) == 0
    assert tables.table.tolist() == [[0, 1]]
    kv.allocate_slots(a, 4)  # 7 tokens: blocks 0-3; the table widens
    tables.update("a", kv.live_block_ids("a"))
    assert tables.table.tolist() == [[0, 1, 2, 3]] and tables.known == [4]
    kv.truncate("a", 4)  # rejected drafts: back to blocks 0, 1
    tables.update("a", kv.live_block_ids("a"))
    assert tables.table.tolist() == [[0, 1, 0, 0]] and tables.known == [2]
    kv.allocate_slots(a, 3)  # drafts again: 7 tokens, 4 blocks
    kv.truncate("a", 4)  # rejected ...
    kv.allocate_slots(a, 3)  # ... and drafted again before the runner looks (same length)
    tables.update("a", kv.live_block_ids("a"))
    assert tables.table[0].tolist() == kv.block_ids("a")
    kv.truncate("a", 4)
    tables.update("a", kv.live_block_ids("a"))
    kv.allocate_slots(b, 2, kv.find_cached_prefix(b))
    (bid,) = kv.block_ids("b")
    assert tables.update("b", kv.live_block_ids("b")) == 1  # a second slot: the table grows a row
    assert tables.table.tolist() == [[0, 1, 0, 0], [bid, 0, 0, 0]]
    assert tables.gather([1, 0, 1], 2).tolist() == [[bid, 0], [0, 1], [bid, 0]]
    tables.release_except(["b"])  # a stopped decoding: its row is cleared and its slot reused
    assert tables.table.tolist() == [[0, 0, 0, 0], [bid, 0, 0, 0]] and tables.slot_of == {"b": 1}
    kv.free("a")
    c = Request("c", [7, 8, 9], SamplingParams())
    kv.allocate_slots(c, 3, kv.find_cached_prefix(c))
    assert tables.update("c", kv.live_block_ids("c")) == 0
    assert tables.table[0, :2].tolist() == kv.block_ids("c")


def test_a_request_admitted_again_gets_its_row_rewritten():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    tables = PersistentBlockTables()
    a = Request("a", [1, 2, 3, 4], SamplingParams())
    kv.allocate_slots(a, 4, kv.find_cached_prefix(a))
    tables.update("a", kv.live_block_ids("a"))
    kv.free("a")  # preempted; another request takes its blocks
    kv.allocate_slots(Request("x", [9, 9], SamplingParams()), 2, None)
    kv.allocate_slots(a, 4, kv.find_cached_prefix(a))  # admitted again: new blocks, a new list
    ids = kv.live_block_ids("a")
    assert ids != [0, 1]
    assert tables.gather([tables.update("a", ids)], 2).tolist() == [ids]


def _slices(chunks):
    chunks = sorted(chunks, key=lambda c: c.num_tokens > 1)  # decodes first, as ModelRunner does
    return [SeqSlice(c.request.all_token_ids[c.request.num_computed_tokens:][:c.num_tokens],
                     c.request.num_computed_tokens, c.block_ids, c.num_tokens == 1, key=c.request.request_id)
            for c in chunks]


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_persistent_tables_equal_tables_built_from_scratch_every_step(data):
    """Random requests through the scheduler (preemption under a small pool, aborts, prefix hits,
    optionally a sliding window): at every step the persistent tables give the decode rows the
    same block ids as tables built from the block lists, at every position the rows can read."""
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    num_blocks = data.draw(st.integers(6, 30))
    window = data.draw(st.sampled_from([None, 3, 7]))
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=data.draw(st.booleans()),
                        sliding_window=window)
    max_len = num_blocks * block_size
    sched = Scheduler(SchedulerConfig(max_num_seqs=data.draw(st.integers(1, 6)),
                                      max_num_batched_tokens=data.draw(st.integers(2, 32)),
                                      max_model_len=max_len), kv)
    tables = PersistentBlockTables(max_blocks_per_seq=2, capacity=2)  # both grow along the way
    rng = data.draw(st.randoms(use_true_random=False))
    for i in range(60):
        if i < 24:
            tokens = [7] * rng.randint(0, 5) + [rng.randint(0, 50) for _ in range(rng.randint(1, max_len // 3))]
            tokens = tokens[:max_len - 1]
            sched.add_request(Request(f"q{i}", tokens,
                                      SamplingParams(max_tokens=rng.randint(1, max(1, max_len - len(tokens))))))
        if rng.random() < 0.05 and sched.requests:
            sched.abort(rng.choice(sorted(sched.requests)))
        out = sched.schedule()
        seqs = _slices(out.chunks)
        fresh = build_batch(seqs, block_size, "cpu").meta
        kept = build_batch(seqs, block_size, "cpu", persistent=tables).meta
        if fresh.decode_tables is None:
            assert kept.decode_tables is None
        else:
            assert torch.equal(kept.decode_lens, fresh.decode_lens)
            got, want = kept.decode_tables.numpy(), fresh.decode_tables.numpy()
            assert got.shape == want.shape and got.dtype == np.int32
            for row, length in enumerate(fresh.decode_lens.tolist()):
                first = 0 if window is None else max(0, length - window) // block_size  # window: readable blocks
                last = -(-length // block_size)
                assert got[row, first:last].tolist() == want[row, first:last].tolist()
        for req in sched.advance(out):
            req.append_output(rng.randint(0, 50))
            if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_len:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
        if not sched.has_unfinished and i >= 24:
            break
    # rows are released at the next step that does not decode them: no row outlives its request
    build_batch(_slices(sched.schedule().chunks), block_size, "cpu", persistent=tables)
    assert set(tables.slot_of) <= set(sched.requests)
