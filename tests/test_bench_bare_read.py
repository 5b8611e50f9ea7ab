"""benchmarks/decode_attention.py's "bare read" row: the floor it reports is only a floor of the kernel's
reads if the C loop reads exactly the lines the kernel reads (every position of every row, K and V, and
int8's scales), no more and no fewer."""

import os
import random
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from decode_attention import bare_reader  # noqa: E402


@pytest.fixture(scope="module")
def reader():
    fn = bare_reader()
    if fn is None:
        pytest.skip("no gcc here")
    return fn


@pytest.mark.parametrize("scaled", [False, True], ids=["no scales", "int8 scales"])
@pytest.mark.parametrize("span", [16, 32])
def test_bare_read_reads_each_position_of_each_row_once(reader, scaled, span):
    bs, kv_heads, row_bytes, part = 16, 3, 192, 64  # rows of 1 to 3 parts, chunks across blocks
    lengths = [1, 15, 17, 40, 64, 65, 150]
    per = [-(-n // bs) for n in lengths]
    pool = list(range(1, sum(per) + 1))
    random.Random(0).shuffle(pool)
    tables = np.zeros((len(lengths), max(per)), dtype=np.int32)
    at = 0
    for r, n in enumerate(per):
        tables[r, :n] = pool[at:at + n]
        at += n
    slots = (sum(per) + 1) * bs
    rng = np.random.default_rng(0)
    k = np.zeros(slots * row_bytes, dtype=np.uint8)
    v = np.zeros_like(k)
    kw, vw = k.view(np.uint64), v.view(np.uint64)  # the first word of each 64-byte line holds a number
    kw[::8] = rng.integers(1, 1000, kw[::8].size)
    vw[::8] = rng.integers(1, 1000, vw[::8].size) * 1000
    ks = rng.integers(1, 50, (slots, kv_heads)).astype(np.uint32) if scaled else None
    vs = rng.integers(1, 50, (slots, kv_heads)).astype(np.uint32) * 50 if scaled else None
    want = 0
    for r, n in enumerate(lengths):
        for p in range(n):
            slot = int(tables[r, p // bs]) * bs + p % bs
            first, count = slot * row_bytes // 8, row_bytes // 64  # the slot's lines, K and V
            want += int(kw[first::8][:count].sum() + vw[first::8][:count].sum())
            if scaled:
                want += int(ks[slot, 0]) + int(vs[slot, 0])
    lens = np.array(lengths, dtype=np.int32)
    got = reader(k.ctypes.data, v.ctypes.data, ks.ctypes.data if scaled else None,
                 vs.ctypes.data if scaled else None, kv_heads * 4, tables.ctypes.data, tables.shape[1],
                 lens.ctypes.data, len(lengths), bs, row_bytes, span, part)
    assert got == want
