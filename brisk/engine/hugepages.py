"""Host buffers backed by transparent huge pages, for the KV cache.

Decode attention walks each row's blocks in an order the block pool decides: at long contexts that
is a jump to another part of a pool of hundreds of MB every block (12 KB of K and of V per layer
on the demo model), and with 4 KB pages nearly every jump misses the TLB. Linux backs a region
with 2 MB pages when asked (madvise MADV_HUGEPAGE; the default policy on most distributions is
"madvise"). The compiled kernel at 64 rows x 2,000 scattered tokens, both in one run
(benchmarks/decode_attention.py --hugepages): 6.46 -> 5.74 ms per layer with float32 KV,
3.64 -> 2.76 ms with bfloat16.

Memory stays lazy: pages are still mapped on first write, 2 MB at a time instead of 4 KB. Each
layer's slice of the K and of the V pool is written from its own start, so resident memory runs
ahead of the blocks in use by at most one huge page per layer and pool. For the demo's 30 layers
that is up to 120 MB: its server's RSS after a short-prompt benchmark went from 1,120 to
1,253-1,270 MB in a same-run A/B. Once the pool has cycled through its blocks (the free queue is
LRU), all of it is resident either way. Where the kernel refuses (another OS, THP disabled), the
buffer is the plain one and nothing else changes. `BRISK_KV_HUGEPAGES=off` asks for 4 KB pages.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys

import numpy as np
import torch

from brisk import switches

log = logging.getLogger(__name__)

HUGE_PAGE = 1 << 21
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def requested() -> bool:
    """BRISK_KV_HUGEPAGES: on (default) or off."""
    return switches.choice("BRISK_KV_HUGEPAGES") == "on"


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge: bool = True) -> torch.Tensor:
    """torch.empty(shape), on CPU aligned to 2 MB and advised to use huge pages when `huge`,
    BRISK_KV_HUGEPAGES is not off, and the buffer spans at least one huge page. The pages are not
    touched here."""
    huge = huge and requested()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise() if huge and device.type == "cpu" and nbytes >= HUGE_PAGE else None
    if madvise is None:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # slack to align the start
    offset = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[offset:offset + nbytes].view(dtype).view(shape)  # keeps `raw` alive
    advised = nbytes // HUGE_PAGE * HUGE_PAGE
    if madvise(buffer.data_ptr(), advised, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): KV cache on 4 KB pages", ctypes.get_errno())
    return buffer


def _mincore():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def populate_rows(buffer: torch.Tensor, rows: int) -> int:
    """Map in the first `rows` rows of each `buffer[i]` (a pool [layers, slots, ...]) now, as a write would
    (MADV_POPULATE_WRITE; through ctypes, so the GIL is free meanwhile): memory written there later skips the
    first touch of fresh pages. Nothing is written. Returns the bytes mapped in (0: not Linux, not CPU, or a
    kernel before 5.14)."""
    madvise = _madvise() if buffer.device.type == "cpu" and buffer.dim() >= 2 else None
    if madvise is None or rows <= 0:
        return 0
    rows = min(rows, buffer.shape[1])
    row_bytes = buffer[0, 0].numel() * buffer.element_size()
    done = 0
    for i in range(buffer.shape[0]):
        start = buffer[i].data_ptr()
        aligned = start // PAGE * PAGE
        if madvise(aligned, start + rows * row_bytes - aligned, MADV_POPULATE_WRITE) != 0:
            log.debug("madvise(MADV_POPULATE_WRITE) refused (errno %d)", ctypes.get_errno())
            return done
        done += rows * row_bytes
    return done


def resident_bytes(buffer: torch.Tensor) -> int | None:
    """Bytes of a CPU buffer that are in memory now (mincore over its pages): how much of a lazily
    touched KV pool the process holds. None where the OS cannot say (not Linux, not CPU)."""
    mincore = _mincore() if buffer.device.type == "cpu" else None
    if mincore is None or buffer.numel() == 0:
        return None
    start = buffer.data_ptr() // PAGE * PAGE
    end = buffer.data_ptr() + buffer.numel() * buffer.element_size()
    pages = -(-(end - start) // PAGE)
    vec = ctypes.create_string_buffer(pages)
    if mincore(start, end - start, vec) != 0:
        return None
    resident = int(np.count_nonzero(np.frombuffer(vec.raw, dtype=np.uint8) & 1))
    return min(resident * PAGE, end - buffer.data_ptr())
