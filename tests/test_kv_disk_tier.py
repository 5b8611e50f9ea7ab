"""The KV disk tier (--kv-cache-dir): cached prompts survive a restart of the engine, exactly.

A "restart" here is a new engine on the same model and folder (what a new `brisk serve` process builds):
its pool is empty, so every prefix it finds comes from disk. Greedy output with the prefix restored equals
the output computed from scratch (brisk's batch-invariant path makes a restored prefix exact), blocks never
cross cache_salt values nor KV dtypes, a corrupt or truncated file is a miss, and the folder stays in its
byte budget."""

from __future__ import annotations

import os

import pytest

from brisk.config import CacheConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.kv_cache.disk_tier import DiskTier
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import SchedulerConfig
from brisk.errors import BriskError

BLOCK = 16
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SYSTEM = ("You are the support assistant of a bicycle shop. Answer in two sentences, cite the manual's section "
          "and never invent part numbers. ") * 6


def engine(demo, folder, kv_cache_dtype="auto", disk_bytes=2**30, prefix=True):
    return LLMEngine(demo, CacheConfig(block_size=BLOCK, num_gpu_blocks_override=512, enable_prefix_caching=prefix,
                                       kv_cache_dtype=kv_cache_dtype, kv_cache_dir=str(folder) if folder else None,
                                       kv_cache_disk_bytes=disk_bytes),
                     SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024))


def prompt(demo, question):
    return demo.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def run(eng, prompts, salt=None):
    """[(token ids, cached prompt tokens)] per prompt, all admitted at once."""
    ids = [eng.add_request(p, GREEDY, cache_salt=salt) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [(done[i].token_ids, done[i].num_cached_prompt_tokens) for i in ids]


@pytest.fixture(scope="module")
def cold(demo):
    """Greedy outputs with no cache at all (no prefix caching, no disk)."""
    eng = engine(demo, None, prefix=False)
    return {q: run(eng, [prompt(demo, q)])[0][0] for q in ("Do you fix flat tyres?", "Where is my order?")}


def test_a_restart_finds_the_prefix_on_disk_and_answers_as_if_cold(demo, cold, tmp_path):
    first = engine(demo, tmp_path)
    p1 = prompt(demo, "Do you fix flat tyres?")
    (tokens, cached), = run(first, [p1])
    assert tokens == cold["Do you fix flat tyres?"] and cached == 0
    assert first.kv.disk_misses_tokens == (len(p1) - 1) // BLOCK * BLOCK  # every full block looked for, none there
    first.close()  # what a drained shutdown does: every queued block written
    assert first.disk.stats.written > 0 and first.disk.stats.write_errors == 0

    second = engine(demo, tmp_path)  # a new process: an empty pool
    p = prompt(demo, "Where is my order?")
    (tokens, cached), = run(second, [p])
    shared = len(SYSTEM) // 8  # ~the system prompt's tokens; at least that much comes from disk
    assert cached >= shared and cached % BLOCK == 0 and cached < len(p), (cached, len(p))
    assert second.disk.stats.hits == cached // BLOCK
    assert second.kv.disk_hits_tokens == cached
    assert second.kv.disk_misses_tokens == (len(p) - 1) // BLOCK * BLOCK - cached  # the blocks past the shared ones
    assert tokens == cold["Where is my order?"]  # the restored prefix gives the same greedy tokens
    (_, again), = run(second, [p])  # the same prompt again: now all in the pool, none read from disk
    assert again >= cached and second.disk.stats.hits == cached // BLOCK
    second.close()


def _slow_disk(eng):
    """The engine's disk tier reads only once the returned event is set (a slow disk, held still)."""
    import threading

    release, read = threading.Event(), eng.disk.get

    def held_get(block_hash):
        assert release.wait(60), "the test never released the disk"
        return read(block_hash)

    eng.disk.get = held_get
    return release


def test_other_requests_run_while_a_prefix_is_read_from_disk(demo, cold, tmp_path):
    """A prefix on disk is read on the tier's own thread: the request waits for it, the others' steps do not."""
    first = engine(demo, tmp_path)
    run(first, [prompt(demo, "Do you fix flat tyres?")])
    first.close()

    second = engine(demo, tmp_path)
    release = _slow_disk(second)
    waiting = second.add_request(prompt(demo, "Where is my order?"), GREEDY)  # first in the queue
    other = second.add_request(demo.tokenizer.encode("Bicycles have two wheels and"), GREEDY)
    finished = {}
    for _ in range(200):  # the other request runs to its end while the disk holds the first one's read
        finished.update({o.request_id: o for o in second.step() if o.finished})
        if other in finished:
            break
    assert other in finished and len(finished[other].token_ids) == GREEDY.max_tokens
    assert waiting not in finished and second.kv.disk_reads_under_way()
    assert second.scheduler.requests[waiting].num_computed_tokens == 0
    release.set()
    for _ in range(500):
        finished.update({o.request_id: o for o in second.step() if o.finished})
        if waiting in finished:
            break
    out = finished[waiting]
    assert out.token_ids == cold["Where is my order?"]  # its prefix came from disk, and the tokens are the same
    assert out.num_cached_prompt_tokens >= len(SYSTEM) // 8 and second.disk.stats.hits > 0
    stats = second.stats()
    assert stats.kv_disk_loads == 1 and stats.kv_disk_load_seconds > 0
    second.close()


def test_a_request_aborted_while_its_prefix_is_read_drops_the_read(demo, tmp_path):
    first = engine(demo, tmp_path)
    run(first, [prompt(demo, "Do you fix flat tyres?")])
    first.close()

    second = engine(demo, tmp_path)
    release = _slow_disk(second)
    rid = second.add_request(prompt(demo, "Where is my order?"), GREEDY)
    second.step()
    assert second.kv.disk_reads_under_way()
    assert second.abort(rid)
    release.set()
    second.disk.close()  # the reader ends after the read under way
    assert not second.kv.disk_reads_under_way() and not second.disk._reads  # nothing kept for it
    assert not second.has_unfinished_requests() and second.kv.num_free_blocks == 512


def test_blocks_never_cross_salts_or_kv_dtypes(demo, tmp_path):
    p = prompt(demo, "Do you fix flat tyres?")
    first = engine(demo, tmp_path, kv_cache_dtype="float32")
    run(first, [p], salt="tenant-a")
    first.close()
    other_salt = engine(demo, tmp_path, kv_cache_dtype="float32")
    assert run(other_salt, [p], salt="tenant-b")[0][1] == 0
    assert run(other_salt, [p], salt="tenant-a")[0][1] > 0  # (the same salt does find them)
    other_salt.close()
    other_dtype = engine(demo, tmp_path, kv_cache_dtype="int8")  # another fingerprint: another folder
    assert other_dtype.disk.folder != other_salt.disk.folder
    assert run(other_dtype, [p], salt="tenant-a")[0][1] == 0
    other_dtype.close()


def test_a_corrupt_or_truncated_block_is_a_miss_and_is_removed(demo, cold, tmp_path):
    first = engine(demo, tmp_path)
    run(first, [prompt(demo, "Do you fix flat tyres?")])
    first.close()
    files = sorted(first.disk.folder.glob("*.kvb"), key=lambda f: f.stat().st_mtime_ns)
    assert len(files) >= 4
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a payload
    files[1].write_bytes(bytes(data))
    files[2].write_bytes(files[2].read_bytes()[:100])  # a truncated write
    second = engine(demo, tmp_path)
    (tokens, _), = run(second, [prompt(demo, "Where is my order?")])
    assert tokens == cold["Where is my order?"]  # never a wrong token
    second.close()
    assert second.disk.stats.corrupt == 1 and second.disk.stats.hits == 1  # the chain stops at the bad block
    # the bad file was removed, the block recomputed and written whole again
    assert second.disk.get(bytes.fromhex(files[1].stem)) is not None
    third = engine(demo, tmp_path)  # the truncated one is found next time: a miss too, and rewritten
    (tokens, cached), = run(third, [prompt(demo, "Where is my order?")])
    assert tokens == cold["Where is my order?"] and third.disk.stats.corrupt == 1 and cached == 2 * BLOCK
    third.close()


def test_the_folder_stays_within_its_budget(demo, tmp_path):
    probe = engine(demo, tmp_path / "probe")
    block = probe.disk.block_bytes
    probe.close()
    budget = 6 * (block + 64)
    eng = engine(demo, tmp_path / "small", disk_bytes=budget)
    prompts = [prompt(demo, f"Question number {i}: what about wheel {i}?") for i in range(4)]
    run(eng, prompts)
    eng.disk.flush()
    assert eng.disk.stats.written > 6 and eng.disk.stats.evicted > 0
    assert eng.disk.disk_bytes() <= budget
    eng.close()


def test_a_folder_that_cannot_be_written_is_one_clear_error(tmp_path):
    """(A folder under a file: root ignores mode bits, not this.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(BriskError, match="--kv-cache-dir .*cannot write there"):
        DiskTier(blocker / "kv", "x", 2**20, 1024)
    with pytest.raises(BriskError, match="holds not even one KV block"):
        DiskTier(tmp_path / "tiny", "x", 100, 1024)


def test_brisk_serve_keeps_its_cached_prompts_across_a_sigterm_restart(demo, tmp_path):
    """The whole path: `brisk serve --kv-cache-dir`, a chat with a long system prompt, SIGTERM (the drain writes
    what is queued), a new process on the same folder: the same chat's prompt now comes mostly from disk
    (usage.prompt_tokens_details.cached_tokens, all of it in usage.brisk.cached_prompt_tokens_by_tier's disk,
    brisk:kv_disk_hits in /metrics), and the greedy reply is the same text."""
    import signal
    import subprocess
    import sys

    import httpx

    from test_serve_process import free_port, wait_for

    messages = [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "Do you fix flat tyres?"}]

    def serve_once() -> tuple[str, int, float, dict]:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "brisk", "serve", "--port", str(port), "--max-model-len", "2048",
                                 "--kv-cache-memory", "128MiB", "--kv-cache-dir", str(tmp_path / "kv")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(url, "/ready", lambda r: r.status_code == 200, timeout_s=120)
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "messages": messages, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            metrics = httpx.get(url + "/metrics", timeout=30).text
            proc.send_signal(signal.SIGTERM)
            log, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, log[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        body = r.json()
        hits = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("brisk:kv_disk_hits_total"))
        # what `brisk doctor` reads of the tier from the same /metrics
        from prometheus_client.parser import text_string_to_metric_families

        from brisk.doctor.checks import _kv_disk_tier
        tier = _kv_disk_tier({s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples})
        assert tier["budget_bytes"] == 16 * 2**30 and tier["tokens_read"] == hits and tier["bytes"] >= 0
        return (body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"], hits,
                body["usage"]["brisk"]["cached_prompt_tokens_by_tier"])

    text, cached, hits, tiers = serve_once()
    assert cached == 0 and hits == 0 and tiers == {"memory": 0, "host": 0, "disk": 0}
    again, cached, hits, tiers = serve_once()
    assert again == text
    assert cached >= 300 and hits == cached, (cached, hits)
    assert tiers == {"memory": 0, "host": 0, "disk": cached}  # a new process: its pool was empty


def test_brisk_serve_with_an_unwritable_folder_is_one_line_before_anything_loads(tmp_path):
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    from test_serve_process import free_port

    proc = subprocess.run([sys.executable, "-m", "brisk", "serve", "--port", str(free_port()), "--kv-cache-dir",
                           str(blocker / "kv")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("brisk: error: --kv-cache-dir") and "cannot write there" in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr and "listening" not in proc.stderr  # pre-flight: before the port is bound


# -- several writers, and writers killed mid-write --------------------------------------------------------------
def _payload(block_hash: bytes, size: int) -> bytes:
    """A block's bytes as a function of its hash (two writers of one block write the same bytes, as in serving)."""
    return (block_hash * (size // len(block_hash) + 1))[:size]


def _write_blocks(folder, budget, size, seed, count, shared):
    """One process's writes: half to blocks every writer writes, half to its own."""
    import hashlib
    import random

    tier = DiskTier(folder, "concurrent", budget, size)
    rng = random.Random(seed)
    for i in range(count):
        key = f"shared-{rng.randrange(shared)}" if rng.random() < 0.5 else f"own-{seed}-{i}"
        block_hash = hashlib.blake2b(key.encode(), digest_size=16).digest()
        tier.put(block_hash, _payload(block_hash, size))
        if i % 16 == 0:
            tier.flush()  # interleave with the other processes instead of queueing everything first
    tier.close()


def _every_file_reads_back(folder, budget, size) -> int:
    reader = DiskTier(folder, "concurrent", budget, size)
    files = list(reader.folder.glob("*.kvb"))
    for f in files:
        block_hash = bytes.fromhex(f.stem)
        assert reader.get(block_hash) == _payload(block_hash, size), f
    assert reader.stats.corrupt == 0 and not list(reader.folder.glob(".*.tmp"))
    reader.close()
    return len(files)


@pytest.mark.parametrize("budget_blocks", [10_000, 40])
def test_several_processes_write_one_folder_safely(tmp_path, budget_blocks):
    """Three processes writing one folder at once, half of their blocks the same ones: every file there reads back
    whole and right, and with a budget smaller than what they write, the folder is within it once they stop."""
    import multiprocessing

    size = 4096
    budget = budget_blocks * (size + 64)
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_blocks, args=(tmp_path, budget, size, seed, 120, 60)) for seed in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
        assert w.exitcode == 0
    files = _every_file_reads_back(tmp_path, budget, size)
    if budget_blocks < 100:
        assert sum(f.stat().st_size for f in (tmp_path / "concurrent").glob("*.kvb")) <= budget
    else:
        assert 3 * 60 <= files <= 60 + 3 * 120  # every distinct block, once


KILL_SCRIPT = """
import sys, time
from brisk.loading.loader import load
sys.path.insert(0, {tests!r})
from test_kv_disk_tier import engine, prompt
demo = load("smollm2-135m-instruct")
eng = engine(demo, {folder!r})
eng.add_request(prompt(demo, {question!r}), __import__("test_kv_disk_tier").GREEDY)
print("running", flush=True)
while True:
    if not eng.has_unfinished_requests():
        eng.add_request(prompt(demo, {question!r} + " again"), __import__("test_kv_disk_tier").GREEDY)
    eng.step()
"""


def test_kill_9_during_writes_never_gives_a_different_token(demo, tmp_path):
    """A bounded loop: an engine process writing blocks is killed (SIGKILL, no drain) at a random moment, three
    times, each on another prompt; then an engine on the folder answers all three exactly as a cold engine does,
    every file left there reads back whole, and no temporary file of a dead writer is left behind."""
    import random
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    folder = tmp_path / "kv"
    questions = ["Do you fix flat tyres?", "Where is my order?", "Can I return a helmet?"]
    rng = random.Random(7)
    for question in questions:
        script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), folder=str(folder), question=question)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        try:
            assert proc.stdout.readline().strip() == "running"
            before = len(list(folder.rglob("*.kvb")))
            deadline = time.monotonic() + 120
            while len(list(folder.rglob("*.kvb"))) == before and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside the writes
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    reference = engine(demo, None, prefix=False)
    cold = [run(reference, [prompt(demo, q)])[0][0] for q in questions]
    warm = engine(demo, folder)
    assert not list(warm.disk.folder.glob(".*.tmp"))  # the dead writers' temporary files were removed
    results = [run(warm, [prompt(demo, q)])[0] for q in questions]
    assert [tokens for tokens, _ in results] == cold
    assert warm.disk.stats.hits > 0 and warm.disk.stats.corrupt == 0
    warm.close()


def test_a_dead_writers_temporary_file_is_removed_and_a_live_ones_kept(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "tmpfiles"
    folder.mkdir()
    orphan = folder / f".{'ab' * 16}.kvb.{int(dead.stdout)}.1.tmp"
    live = folder / f".{'cd' * 16}.kvb.{os.getpid()}.1.tmp"
    for f in (orphan, live):
        f.write_bytes(b"half a block")
    DiskTier(tmp_path, "tmpfiles", 2**20, 1024).close()
    assert not orphan.exists() and live.exists()


def test_files_of_the_first_layout_are_still_read_and_a_flipped_bit_is_refused(tmp_path):
    """BRISKKV2 files carry a CRC-32; BRISKKV1 files (blake2b-128), written before, are still read. One flipped
    payload bit in either is a miss, and the file goes."""
    import hashlib
    import zlib

    from brisk.engine.kv_cache.disk_tier import MAGIC, MAGIC_V1

    tier = DiskTier(tmp_path, "x", 2**20, 64)
    payload = os.urandom(64)
    old = b"\x01" * 16
    tier.path(old).write_bytes(MAGIC_V1 + (64).to_bytes(8, "little") + hashlib.blake2b(payload, digest_size=16).digest()
                               + payload)
    assert tier.get(old) == payload
    new = b"\x02" * 16
    tier.put(new, payload)
    tier.flush()
    data = tier.path(new).read_bytes()
    assert data[:8] == MAGIC and data[16:20] == zlib.crc32(payload).to_bytes(4, "little") and tier.get(new) == payload
    for block_hash, raw in ((old, tier.path(old).read_bytes()), (new, data)):
        bad = bytearray(raw)
        bad[-7] ^= 0x10
        tier.path(block_hash).write_bytes(bytes(bad))
        assert tier.get(block_hash) is None and not tier.path(block_hash).exists()
    assert tier.stats.corrupt == 2
    tier.close()


def test_populate_rows_maps_in_the_first_rows_of_every_layer():
    """On a fresh anonymous mapping (not the allocator's memory, which an earlier test may have touched or advised
    to use huge pages): the first rows of each layer are mapped in, and not much more (huge pages, where the
    kernel uses them for every mapping, round each layer's part up to 2 MB pages)."""
    import mmap

    import torch

    from brisk.engine import hugepages

    layers, rows, row_bytes = 2, 16384, 1024  # 16 MB a layer
    area = mmap.mmap(-1, layers * rows * row_bytes)
    pool = torch.frombuffer(area, dtype=torch.float32).view(layers, rows, row_bytes // 4)
    assert hugepages.resident_bytes(pool) == 0
    mapped = hugepages.populate_rows(pool, 1024)
    assert mapped == layers * 1024 * row_bytes
    after = hugepages.resident_bytes(pool)
    assert mapped <= after <= layers * 2 * hugepages.HUGE_PAGE, (mapped, after)  # of the 32 MB mapping
    del pool
    area.close()


def test_a_restarted_engine_maps_in_as_much_of_its_pool_as_the_tier_holds(demo, tmp_path):
    """A new engine on a folder holding N blocks maps in its pool's first N blocks (every layer's K and V) on a
    thread of its own: the blocks read back after a restart go there, into memory already mapped."""
    first = engine(demo, tmp_path)
    assert first.prefault_thread is None  # an empty folder: nothing to read back
    run(first, [prompt(demo, "Do you fix flat tyres?")])
    first.close()
    files = len(list(first.disk.folder.glob("*.kvb")))
    second = engine(demo, tmp_path)
    second.prefault_thread.join(timeout=60)
    kv = second.runner.kv
    per_slot = sum(t[0, 0].numel() * t.element_size() * t.shape[0] for t in (kv.k, kv.v))
    assert files > 0 and second.prefaulted_bytes == files * BLOCK * per_slot
    second.close()
    assert engine(demo, None).prefault_thread is None  # no tier, nothing mapped ahead


def test_the_folder_never_passes_its_budget_even_between_a_write_and_its_eviction(tmp_path, monkeypatch):
    """The size of the folder right after every file lands is within the budget: room is made before a write."""
    from brisk.engine.kv_cache.disk_tier import HEADER_BYTES

    budget = 5 * (HEADER_BYTES + 64)
    tier = DiskTier(tmp_path, "x", budget, 64)
    sizes, real_replace = [], os.replace

    def replace(src, dst):
        real_replace(src, dst)
        if os.path.dirname(dst) == str(tier.folder):  # this tier's writes only (other threads may replace too)
            sizes.append(tier.disk_bytes())

    monkeypatch.setattr(os, "replace", replace)
    for i in range(40):
        tier.put(i.to_bytes(16, "little"), bytes([i]) * 64)
        tier.flush()
    assert len(sizes) == 40 and max(sizes) <= budget and tier.stats.evicted >= 35, (max(sizes), budget)
    tier.close()
