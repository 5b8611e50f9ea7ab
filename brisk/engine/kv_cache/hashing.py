"""Chained hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash and its own token ids (plus an optional
per-request salt), so equal hashes mean equal prefixes, not just equal blocks.
blake2b with a 128-bit digest keeps accidental collisions out of reach; a collision
would silently serve another prompt's K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"salt:" + salt.encode())
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                     known: list[BlockHash] | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending the already-known prefix of hashes."""
    hashes = list(known or [])
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start:start + block_size], salt))
    return hashes
