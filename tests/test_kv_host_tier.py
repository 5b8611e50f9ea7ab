"""The KV host tier (--kv-cache-host-bytes): cached blocks the pool evicts are kept in host memory and taken back,
exactly, when their prefix returns.

The pool here is a few blocks more than one request needs, so serving a second, different prompt evicts the first
one's prefix; the first prompt's system prompt then comes back from the host tier instead of being recomputed, and
the greedy tokens equal those computed from scratch (brisk's batch-invariant path makes a restored prefix exact)."""

from __future__ import annotations

import pytest

from brisk.config import CacheConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.kv_cache.host_tier import HostTier
from brisk.engine.kv_cache.manager import KVCacheManager
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import SchedulerConfig
from brisk.errors import BriskError

BLOCK = 16
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SHOP = ("You are the support assistant of a bicycle shop. Answer in two sentences, cite the manual's section "
        "and never invent part numbers. ") * 5
BAKERY = ("You take orders for a bakery. Ask for the pickup day, list the breads that are left and confirm the "
          "total before you end the chat. ") * 5


def engine(demo, host_bytes=0, blocks=16, folder=None, prefix=True):
    """16 blocks of 16 tokens: one max-length (256) sequence; each prompt here is ~13 blocks with its reply."""
    return LLMEngine(demo, CacheConfig(block_size=BLOCK, num_gpu_blocks_override=blocks, enable_prefix_caching=prefix,
                                       kv_cache_host_bytes=host_bytes,
                                       kv_cache_dir=str(folder) if folder else None),
                     SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256))


def prompt(demo, system, question):
    return demo.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])


def run(eng, p):
    """(token ids, cached prompt tokens, of those from the host tier) of one request run alone."""
    rid = eng.add_request(p, GREEDY)
    done = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished and out.request_id == rid:
                done = out
    return done.token_ids, done.num_cached_prompt_tokens, done.num_host_prompt_tokens


@pytest.fixture(scope="module")
def cold(demo):
    eng = engine(demo, prefix=False)
    out = {q: run(eng, prompt(demo, SHOP, q))[0] for q in ("Do you fix flat tyres?", "Where is my order?")}
    out["Can I order a cake?"] = run(eng, prompt(demo, BAKERY, "Can I order a cake?"))[0]
    return out


def test_an_evicted_prefix_comes_back_from_host_memory_exactly(demo, cold):
    eng = engine(demo, host_bytes=2**30)
    tokens, cached, _ = run(eng, prompt(demo, SHOP, "Do you fix flat tyres?"))
    assert tokens == cold["Do you fix flat tyres?"] and cached == 0
    run(eng, prompt(demo, BAKERY, "Do you have rye bread?"))  # its blocks take the pool's cached ones
    assert eng.host.stats.stored > 0 and eng.kv.pool.num_evictions >= eng.host.stats.stored

    p = prompt(demo, SHOP, "Where is my order?")
    tokens, cached, host = run(eng, p)
    assert tokens == cold["Where is my order?"]  # the restored prefix gives the same greedy tokens
    shared = len(SHOP) // 8  # ~the system prompt's tokens: the pool's blocks and the tier's cover it
    assert cached >= shared and host >= 3 * BLOCK and host % BLOCK == 0 and cached > host, (cached, host, len(p))
    assert eng.kv.host_hits_tokens == host and eng.host.stats.hits == host // BLOCK
    stats = eng.stats()
    assert stats.kv_host_hits_tokens == host and stats.kv_host_blocks_stored == eng.host.stats.stored
    assert stats.kv_host_bytes == eng.host.size_bytes <= stats.kv_host_budget_bytes
    # the bakery's blocks were spilled as the shop's came back into them: copied out before they were overwritten
    tokens, _, host = run(eng, prompt(demo, BAKERY, "Can I order a cake?"))
    assert tokens == cold["Can I order a cake?"] and host >= 3 * BLOCK

    # without the tier, the same traffic recomputes the prefix
    bare = engine(demo)
    run(bare, prompt(demo, SHOP, "Do you fix flat tyres?"))
    run(bare, prompt(demo, BAKERY, "Do you have rye bread?"))
    tokens, cached, host = run(bare, p)
    assert tokens == cold["Where is my order?"] and host == 0 and cached < shared, cached


def test_a_prefix_evicted_and_wanted_in_one_step_is_taken_back_not_recomputed(demo, cold):
    """Two requests admitted in one step: the first one's allocation evicts blocks of the shop's system prompt,
    which the second one's prompt starts with. Those blocks have not reached the host tier yet (they are copied
    out before the step's forward), but their bytes are still in the pool: the second request takes them from
    there (a PendingSpill) instead of recomputing them, exactly, and they never enter the tier."""
    from brisk.engine.kv_cache.hashing import hash_full_blocks

    eng = LLMEngine(demo, CacheConfig(block_size=BLOCK, num_gpu_blocks_override=48, kv_cache_host_bytes=2**30),
                    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=768))
    run(eng, prompt(demo, SHOP, "Do you fix flat tyres?"))
    run(eng, prompt(demo, BAKERY, "Do you have rye bread?"))  # freed after the shop's: behind them in the queue
    p = prompt(demo, SHOP, "Where is my order?")
    first = prompt(demo, SHOP, "Do you fix flat tyres?")
    same = next(i for i, (x, y) in enumerate(zip(p, first)) if x != y) // BLOCK  # full blocks the two share
    shared = hash_full_blocks(p, BLOCK)[:same]
    queue = list(eng.kv.pool.free_blocks.values())  # the order allocation takes them in
    at = max(i for i, b in enumerate(queue) if b.block_hash in shared[-2:])
    evicted = {b.block_hash for b in queue[:at + 1] if b.block_hash in shared}
    assert len(evicted) == 2  # the shared prefix's last two blocks go to the long request
    long_prompt = [demo.tokenizer.encode(" bicycle")[0]] * ((at + 1) * BLOCK - 3)
    eng.add_request(long_prompt, SamplingParams(max_tokens=1, temperature=0))
    rid = eng.add_request(p, GREEDY)
    done = None
    first_step = True
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished and out.request_id == rid:
                done = out
        if first_step:  # both were admitted in it; the two blocks went back into the pool, not to the tier
            assert not any(eng.host.has(h) for h in evicted) and eng.host.stats.stored > 0
            first_step = False
    assert done.token_ids == cold["Where is my order?"]
    assert done.num_host_prompt_tokens == 2 * BLOCK and done.num_cached_prompt_tokens == same * BLOCK
    assert eng.host.stats.hits == 0  # (taken from the pool's own bytes, not from the tier)


def test_the_tier_stays_within_its_budget_and_a_partial_prefix_is_still_exact(demo, cold):
    budget = 3 * engine(demo).runner.kv.block_nbytes(BLOCK)
    eng = engine(demo, host_bytes=budget)
    run(eng, prompt(demo, SHOP, "Do you fix flat tyres?"))
    run(eng, prompt(demo, BAKERY, "Do you have rye bread?"))
    assert len(eng.host) == 3 and eng.host.size_bytes <= budget
    assert eng.host.stats.evicted == eng.host.stats.stored - 3 > 0
    tokens, cached, host = run(eng, prompt(demo, SHOP, "Where is my order?"))
    assert tokens == cold["Where is my order?"]
    assert 0 < host <= 3 * BLOCK  # at most what the tier held, and only a run that continues the pool's blocks


def test_the_host_tier_comes_before_the_disk_and_the_disk_outlives_it(demo, cold, tmp_path):
    eng = engine(demo, host_bytes=2**30, folder=tmp_path)
    run(eng, prompt(demo, SHOP, "Do you fix flat tyres?"))
    run(eng, prompt(demo, BAKERY, "Do you have rye bread?"))
    p = prompt(demo, SHOP, "Where is my order?")
    tokens, cached, host = run(eng, p)
    assert tokens == cold["Where is my order?"] and host > 0
    assert eng.disk.stats.hits == 0  # found in memory first: nothing read from disk
    eng.close()
    restarted = engine(demo, host_bytes=2**30, folder=tmp_path)  # a new process: host memory is gone, the disk not
    tokens, cached, host = run(restarted, p)
    assert tokens == cold["Where is my order?"] and host == 0 and restarted.kv.disk_hits_tokens == cached > 0
    restarted.close()


def test_bad_sizes_are_one_clear_error(demo):
    with pytest.raises(BriskError, match="--kv-cache-host-bytes .*not even one KV block"):
        HostTier(100, 1024)
    with pytest.raises(BriskError, match="--kv-cache-host-bytes .*more than the .* GiB of host memory"):
        engine(demo, host_bytes=2**60)
    import argparse

    from brisk.engine.factory import add_engine_args, engine_configs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(BriskError, match="--kv-cache-host-bytes: memory size 'lots'"):
        engine_configs(parser.parse_args(["--kv-cache-host-bytes", "lots"]), 256)
    cache, _ = engine_configs(parser.parse_args(["--kv-cache-host-bytes", "2GiB"]), 256)
    assert cache.kv_cache_host_bytes == 2 * 2**30


def test_the_tier_keeps_the_least_recently_stored_out_first():
    tier = HostTier(3 * 4, 4)
    for i in range(4):
        tier.put(bytes([i]), bytes([i]) * 4)
    assert not tier.has(b"\x00") and len(tier) == 3 and tier.stats.evicted == 1
    assert tier.peek(b"\x01") == b"\x01" * 4  # a peek moves nothing
    tier.put(b"\x04", b"\x04" * 4)
    assert not tier.has(b"\x01")
    assert tier.take(b"\x02") == b"\x02" * 4 and not tier.has(b"\x02") and tier.stats.hits == 1
    with pytest.raises(ValueError, match="4 bytes"):
        tier.put(b"\x05", b"xx")


class _Req:
    def __init__(self, rid, tokens):
        self.request_id, self.cache_salt, self.all_token_ids = rid, None, tokens


def test_the_manager_spills_evicted_blocks_and_takes_them_back_once():
    """Torch-free: a pool of 4 blocks of 2 tokens; the first request's cached blocks are spilled when the second
    needs the pool, handed back (with the tier's bytes) to a third request with the first one's prefix, and leave
    the tier as they go back into the pool."""
    kv = KVCacheManager(4, 2, host=HostTier(100, 1))
    a = _Req("a", [1, 2, 3, 4, 5, 6, 7])
    assert kv.allocate_slots(a, 7, kv.find_cached_prefix(a)) is not None
    kv.cache_full_blocks(a, 7)
    a_full = kv.block_ids("a")[:3]
    kv.free("a")
    assert kv.take_spills() == []  # nothing evicted yet
    b = _Req("b", [9, 9, 9, 9, 9, 9, 9, 9])
    assert kv.allocate_slots(b, 8, kv.find_cached_prefix(b)) is not None
    spills = kv.take_spills()
    assert sorted(i for i, _ in spills) == sorted(a_full)  # a's three full blocks, evicted for b
    for _, block_hash in spills:  # what the engine does: copy each out
        kv.host.put(block_hash, b"k")
    kv.free("b")

    c = _Req("c", [1, 2, 3, 4, 5, 6, 8])
    hit = kv.find_cached_prefix(c)
    assert hit.num_host_blocks == 3 and hit.num_tokens == 6 and hit.blocks == []
    assert len(kv.host) == 3  # looking takes nothing
    new = kv.allocate_slots(c, 1, hit)
    assert len(kv.host) == 0 and kv.host_hits_tokens == 6
    assert kv.host_misses_tokens == 12  # a's and b's three full blocks each, looked for before anything was there
    assert [i for i, _ in kv.take_loads()] == [x.block_id for x in new[:3]]


def test_a_block_spilled_in_this_step_is_found_before_it_reaches_the_tier():
    """Torch-free: c's prefix continues into a block b's allocation evicted moments ago, before the engine
    copied it out: the hit points at that block's bytes (a PendingSpill), c's new block takes them, and the
    tier never gets a copy (the engine skips a spill taken back; tested with the engine above)."""
    from brisk.engine.kv_cache.manager import PendingSpill

    kv = KVCacheManager(12, 2, host=HostTier(100, 1))
    d = _Req("d", [7, 7, 7])
    kv.allocate_slots(d, 3, kv.find_cached_prefix(d))
    a = _Req("a", [1, 2, 3, 4, 5, 6, 7])
    kv.allocate_slots(a, 7, kv.find_cached_prefix(a))
    kv.cache_full_blocks(a, 7)
    a_blocks = kv.block_ids("a")
    kv.free("a")
    kv.free("d")  # behind a's blocks in the queue: room left after b takes a's last ones
    b = _Req("b", [9] * 16)
    assert kv.allocate_slots(b, 16, kv.find_cached_prefix(b)) is not None
    assert [i for i, _ in kv.pool.spills] == [a_blocks[2]]  # a's third full block (its 4th is partial)
    c = _Req("c", [1, 2, 3, 4, 5, 6, 8])
    hit = kv.find_cached_prefix(c)
    assert [blk.block_id for blk in hit.blocks] == a_blocks[:2] and hit.num_tokens == 6
    assert hit.num_host_blocks == 1 and hit.loaded[0][1] == PendingSpill(a_blocks[2])
    new = kv.allocate_slots(c, 1, hit)
    assert kv.take_loads() == [(new[0].block_id, PendingSpill(a_blocks[2]))] and kv.host_hits_tokens == 2
    assert kv.take_spills() == [(a_blocks[2], hit.loaded[0][0])] and len(kv.host) == 0


def test_the_server_reports_the_host_tier_in_usage_and_metrics(demo, cold):
    """Through the HTTP API: usage.brisk.cached_prompt_tokens_by_tier's host part, brisk:kv_host_* in /metrics,
    and what `brisk doctor` reads of them."""
    from prometheus_client.parser import text_string_to_metric_families

    from brisk.doctor.checks import _kv_host_tier
    from live_server import serve_engine

    def ask(client, system, question):
        r = client.post("/v1/completions", json={"prompt": demo.tokenizer.decode(prompt(demo, system, question)),
                                                 "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    with serve_engine(engine(demo, host_bytes=2**30)) as live, live.client() as client:
        ask(client, SHOP, "Do you fix flat tyres?")
        ask(client, BAKERY, "Do you have rye bread?")
        body = ask(client, SHOP, "Where is my order?")
        metrics = client.get("/metrics").text
    tiers = body["usage"]["brisk"]["cached_prompt_tokens_by_tier"]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert tiers["host"] >= 3 * BLOCK and tiers["disk"] == 0 and tiers["memory"] + tiers["host"] == cached, tiers
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert values["brisk:kv_host_hits_total"] == tiers["host"] and values["brisk:kv_host_budget_bytes"] == 2**30
    assert values["brisk:kv_host_blocks_stored_total"] > 0
    assert values["brisk:kv_host_misses_total"] > 0  # the first two prompts: nothing there yet
    assert _kv_host_tier(values) == {"budget_bytes": 2**30, "bytes": int(values["brisk:kv_host_bytes"]),
                                     "tokens_read": tiers["host"],
                                     "tokens_missed": int(values["brisk:kv_host_misses_total"]),
                                     "blocks_stored": int(values["brisk:kv_host_blocks_stored_total"])}
