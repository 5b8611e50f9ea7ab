"""The KV cache's huge-page buffers (brisk/engine/hugepages.py): same tensor semantics as
torch.empty, 2 MB-aligned, and, where the kernel's THP policy allows madvise, actually backed by
huge pages once written (read back from /proc/self/smaps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from brisk.engine import hugepages
from brisk.engine.attention import PagedKVCache
from brisk.errors import BriskError
from brisk.kv_dtype import FLOAT32

CPU = torch.device("cpu")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_buffer_is_aligned_and_behaves_as_empty():
    t = hugepages.empty((3, 10000, 2, 64), torch.bfloat16, CPU)  # 7.3 MiB
    assert t.shape == (3, 10000, 2, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(1.5)
    assert t.eq(1.5).all()
    small = hugepages.empty((4, 4), torch.float32, CPU)  # under one huge page: a plain tensor
    assert small.shape == (4, 4)
    plain = hugepages.empty((3, 1000, 2, 64), torch.float32, CPU, huge=False)
    assert plain.shape == (3, 1000, 2, 64)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="this kernel has THP disabled")
def test_written_pool_is_backed_by_huge_pages():
    cache = PagedKVCache(2, 16 * 2048, 4, 64, FLOAT32, CPU)  # 16 MiB per tensor
    assert cache.k[:, 0].eq(0).all() and cache.v[:, 0].eq(0).all()  # the padding slot, as before
    cache.k.fill_(1.0)
    assert anon_huge_kb(cache.k.data_ptr()) >= 2048, "the written pool holds no huge page"
    if "[madvise]" in THP.read_text():  # huge pages only where asked for: the plain pool has none
        plain = PagedKVCache(2, 16 * 2048, 4, 64, FLOAT32, CPU, huge_pages=False)
        plain.k.fill_(1.0)
        assert anon_huge_kb(plain.k.data_ptr()) == 0


@pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                    reason="only under the madvise policy does asking make the difference")
def test_hugepages_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("BRISK_KV_HUGEPAGES", "off")
    cache = PagedKVCache(2, 16 * 2048, 4, 64, FLOAT32, CPU)
    cache.k.fill_(1.0)
    assert anon_huge_kb(cache.k.data_ptr()) == 0


def test_a_bad_hugepages_setting_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("BRISK_KV_HUGEPAGES", "yes")
    with pytest.raises(BriskError, match="BRISK_KV_HUGEPAGES='yes': expected one of on, off"):
        PagedKVCache(2, 16 * 2048, 4, 64, FLOAT32, CPU)


RESIDENT_CHECK = """
import torch
from brisk.engine import hugepages
from brisk.engine.attention import PagedKVCache
from brisk.kv_dtype import FLOAT32
huge = hugepages.requested()
cache = PagedKVCache(4, 16384, 2, 64, FLOAT32, torch.device("cpu"))  # 2 x 32 MiB
assert cache.nbytes == 2 * 4 * 16384 * 2 * 64 * 4
base = cache.resident_bytes()  # slot 0 of each layer is zeroed at creation
assert base is not None and base <= 2 * 4 * (hugepages.HUGE_PAGE if huge else 4096), base
cache.k[1, 5000:7000].fill_(1.0)  # 1 MiB of layer 1's K, past the huge page slot 0 is in
grown = cache.resident_bytes() - base
assert 2000 * 2 * 64 * 4 <= grown <= 2000 * 2 * 64 * 4 + 2 * (hugepages.HUGE_PAGE if huge else 4096), grown
cache.k.fill_(0.0)
cache.v.fill_(0.0)
assert cache.resident_bytes() == cache.nbytes
"""


@pytest.mark.parametrize("huge", [True, False])
def test_resident_bytes_follow_the_pages_written(huge):
    """brisk:kv_cache_resident_bytes: nothing of a fresh pool is in memory, the pages written are
    (whole huge pages when they back the buffer), and a fully written pool is resident in full. In a
    fresh process: a long-lived one may hand the pool memory it touched before."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "BRISK_KV_HUGEPAGES": "on" if huge else "off"}
    proc = subprocess.run([sys.executable, "-c", RESIDENT_CHECK], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
