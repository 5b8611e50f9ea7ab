"""Block tables for kernel tests, shared by tests/test_paged_attention_kernel.py and
tests/test_kv_dtypes.py."""

from __future__ import annotations

import random


def scattered(lengths: list[int], bs: int, num_blocks: int, seed: int, spare: bool = True) -> list[list[int]]:
    """Block tables as the KV manager hands them out: disjoint, shuffled, never block 0; with `spare`
    a table may hold a block more than it uses."""
    rng = random.Random(seed)
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    tables, used = [], 0
    for n in lengths:
        blocks = -(-n // bs) + (rng.randint(0, 1) if spare else 0)
        tables.append(pool[used:used + blocks])
        used += blocks
    assert used < num_blocks
    return tables
