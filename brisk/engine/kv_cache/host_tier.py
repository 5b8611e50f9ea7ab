"""KV blocks the pool evicts, kept in host memory (issue 65's host tier, `--kv-cache-host-bytes`).

When the pool must reuse a block that still holds a cached prefix, the engine copies the block's bytes
here before the step overwrites it (`KVCacheManager.take_spills`); a later request whose prefix continues
past the pool's blocks takes them back from here before it looks on disk, and the engine copies them into
fresh pool blocks. A block lives in the pool or here, not in both: taking it back removes it (the pool
spills it again when it evicts it again); a block evicted and wanted in the same step goes from its old pool
block to its new one and never comes here (`manager.PendingSpill`). The least recently stored or used
blocks leave first once the tier passes `max_bytes`.

On a GPU this is the CPU memory behind the device's pool (vLLM's CPU offloading, SGLang's HiCache host
layer): a prefix that no longer fits on the device costs a copy instead of a prefill. On a CPU the pool
is host memory too, and this tier is a second, elastic budget beside the fixed pool: the pool is sized
for the running batch, this for the prefixes of the users who come back.

Torch-free: the engine hands bytes in and takes bytes out. Used by the engine's thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from brisk.errors import BriskError


@dataclass
class HostTierStats:
    hits: int = 0  # blocks taken back into the pool
    stored: int = 0  # blocks the pool spilled here
    evicted: int = 0  # blocks dropped to stay within the budget


class HostTier:
    def __init__(self, max_bytes: int, block_bytes: int):
        if max_bytes < block_bytes:
            raise BriskError(f"--kv-cache-host-bytes {max_bytes} holds not even one KV block ({block_bytes} bytes); "
                             "give it more, or leave the flag out")
        self.max_bytes = max_bytes
        self.block_bytes = block_bytes
        self.stats = HostTierStats()
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # block hash -> payload, least recent first

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def size_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def peek(self, block_hash: bytes) -> bytes | None:
        """The block's bytes, leaving it here and its place in the order as it is (a request that may not be
        admitted this step)."""
        return self._blocks.get(block_hash)

    def take(self, block_hash: bytes) -> bytes | None:
        """The block's bytes, removed from the tier (it goes back into the pool)."""
        payload = self._blocks.pop(block_hash, None)
        if payload is not None:
            self.stats.hits += 1
        return payload

    def put(self, block_hash: bytes, payload: bytes) -> None:
        """Keep a block the pool evicted; the least recent ones leave while the tier is over its budget."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a KV block is {self.block_bytes} bytes, got {len(payload)}")
        self._blocks[block_hash] = payload
        self._blocks.move_to_end(block_hash)
        self.stats.stored += 1
        while self.size_bytes > self.max_bytes:
            self._blocks.popitem(last=False)
            self.stats.evicted += 1
