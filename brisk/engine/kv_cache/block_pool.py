"""The pool of KV blocks: reference counts, a free queue in LRU order, and the
prefix-cache map from block hash to block.

A block whose reference count drops to zero goes to the tail of the free queue but
keeps its hash, so a later request with the same prefix can revive it; allocation
takes blocks from the head, evicting the least recently freed cached block first. With
`record_spills()`, allocation also notes each cached block it evicts (its id and hash), so that its
bytes can be copied to the host tier before anything overwrites them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from brisk.engine.kv_cache.hashing import BlockHash


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (head = least recently freed)
        self.free_blocks: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.hash_to_block: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.spills: list[tuple[int, BlockHash]] | None = None  # cached blocks allocation evicted, when recorded

    def record_spills(self) -> None:
        """From now on, `allocate` notes in `spills` each cached block it evicts (the caller empties it)."""
        self.spills = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including cached ones that allocation may evict."""
        return len(self.free_blocks)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_blocks.values() if b.block_hash is not None)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.hash_to_block.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on (possibly free, cached) blocks shared from the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_blocks[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """`num_blocks` fresh blocks with ref_cnt 1, or None when the pool cannot supply them."""
        if num_blocks > len(self.free_blocks):
            return None
        out = []
        for _ in range(num_blocks):
            _, block = self.free_blocks.popitem(last=False)
            if self.spills is not None and block.block_hash is not None \
                    and self.hash_to_block.get(block.block_hash) is block:
                self.spills.append((block.block_id, block.block_hash))
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue tail
        in the given order (callers pass a request's blocks tail-first, so a prefix's
        last blocks are evicted before its first ones)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.hash_to_block:
            block.block_hash = block_hash
            self.hash_to_block[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) is block:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        for block in self.free_blocks.values():
            self._evict(block)
