"""KV cache manager: the scheduler's only view of KV memory.

It answers "give this request slots for N more tokens" with the new blocks or with
None when memory is full (a normal condition the scheduler handles by waiting or
preempting), finds the longest cached prefix of a new request, registers full
blocks in the prefix cache once computed, and frees a request's blocks. A prefix is looked up in the
pool, then in the host tier (host_tier.py: the blocks the pool evicted, which `take_spills` hands to the
engine to copy out), then in the disk tier (disk_tier.py), whose blocks are read ahead: the scheduler asks
`disk_read_pending` before admitting a request, which starts the read on the tier's reader thread the first
time (other requests are admitted meanwhile). Blocks from either tier get fresh blocks whose bytes the
engine copies in before the step's forward (`take_loads`). Every full block computed is handed to the engine
to write out (`take_written`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from brisk.engine.kv_cache.block_pool import BlockPool, KVBlock
from brisk.engine.kv_cache.hashing import BlockHash, hash_full_blocks


class CacheableRequest(Protocol):
    request_id: str
    cache_salt: str | None

    @property
    def all_token_ids(self) -> Sequence[int]: ...


@dataclass
class PrefixHit:
    blocks: list[KVBlock]
    num_tokens: int  # the pool's blocks and the tiers'
    # blocks after `blocks` whose bytes come from a tier: the host tier's first (or, for a block this step
    # evicted, its old pool block: a PendingSpill), then the disk's
    loaded: list[tuple[BlockHash, bytes | PendingSpill]] = field(default_factory=list)
    num_host_blocks: int = 0  # of `loaded`, those from the host tier
    num_past_pool_blocks: int = 0  # full blocks past the pool's: what the tiers were asked for

    @property
    def num_disk_blocks(self) -> int:
        return len(self.loaded) - self.num_host_blocks


@dataclass(frozen=True)
class PendingSpill:
    """The bytes of a prefix block this step's allocation evicted and has not yet copied to the host tier:
    they are still in pool block `block_id` (now another request's) until the step's forward. The engine reads
    them there with the step's other spills and copies them into the block that takes the prefix back, so a
    prefix evicted and wanted in one step is not recomputed."""
    block_id: int


@dataclass(frozen=True)
class KVCacheUsage:
    num_blocks: int
    num_used_blocks: int  # held by at least one request
    num_cached_free_blocks: int  # free but still holding a reusable prefix
    num_used_slots: int  # token slots holding K/V of live requests (shared blocks count once)
    block_size: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def internal_fragmentation(self) -> float:
        """Reserved-but-unfilled slots in used blocks / slots of used blocks."""
        if not self.num_used_blocks:
            return 0.0
        return 1 - self.num_used_slots / (self.num_used_blocks * self.block_size)


@dataclass(frozen=True)
class _Reading:
    """A disk read under way for these consecutive blocks."""
    hashes: list[BlockHash]


# Stands in a request's block list for a block freed because it fell out of the sliding window:
# positions keep their block index, and the block table points at block 0 there (finite values,
# never read: the window excludes those positions).
WINDOW_FREED = KVBlock(block_id=0, ref_cnt=1)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, disk: Any = None, host: Any = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # the same blocks' ids, one list per request changed in place while it only grows: the
        # model runner's persistent block tables read it (live_block_ids) and copy only what is new
        self.req_block_ids: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_tokens: dict[str, int] = {}  # tokens whose slots are allocated
        self.req_num_cached_blocks: dict[str, int] = {}  # leading blocks registered in the prefix cache
        self.req_num_window_freed: dict[str, int] = {}  # leading blocks freed out of the sliding window
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        # the disk tier (a DiskTier, or None): blocks read for a request admitted with them wait in `_loads` for
        # the engine to copy in; blocks registered in the prefix cache wait in `_written` to be written out
        self.disk = disk if enable_prefix_caching else None
        self.disk_hits_tokens = 0
        self.host = None  # the host tier (a HostTier, or None): set_host_tier
        self.host_hits_tokens = 0
        # prompt tokens (full blocks) a tier was asked for at admission and did not have: past the pool's
        # blocks for the host tier, past the pool's and the host tier's for the disk tier
        self.host_misses_tokens = 0
        self.disk_misses_tokens = 0
        if host is not None:
            self.set_host_tier(host)
        self._loads: list[tuple[int, bytes | PendingSpill]] = []
        self._written: list[tuple[int, BlockHash]] = []
        # a waiting request's disk read: a _Reading while under way, then the blocks read (hash -> bytes)
        self._disk_reads: dict[str, dict[BlockHash, bytes] | _Reading] = {}

    def set_host_tier(self, host: Any) -> None:
        """Keep the cached blocks the pool evicts in `host` (a HostTier): the engine copies each out before the
        step that reuses the block (`take_spills`)."""
        if not self.pool.enable_caching:
            return
        self.host = host
        self.pool.record_spills()

    def _hashes(self, request: CacheableRequest) -> list[BlockHash]:
        known = self.req_hashes.get(request.request_id)
        hashes = hash_full_blocks(request.all_token_ids, self.block_size, request.cache_salt, known)
        self.req_hashes[request.request_id] = hashes
        return hashes

    def _pool_prefix(self, request: CacheableRequest) -> tuple[list[KVBlock], list[BlockHash]]:
        """The request's leading blocks found in the pool, and the hashes of the full blocks after them (at least
        one token is always left to compute, since its logits are needed)."""
        max_blocks = (len(request.all_token_ids) - 1) // self.block_size
        blocks = []
        hashes = self._hashes(request)[:max_blocks]
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, hashes[len(blocks):]

    def _host_prefix(self, hashes: list[BlockHash]) -> list[tuple[BlockHash, bytes | PendingSpill]]:
        """The leading blocks of `hashes` the host tier holds, with their bytes (left there until admission), or
        on their way there: evicted by this step's allocations and not yet copied out (a `PendingSpill`)."""
        found: list[tuple[BlockHash, bytes | PendingSpill]] = []
        if self.host is not None:
            pending = {block_hash: block_id for block_id, block_hash in self.pool.spills or ()}
            for block_hash in hashes:
                payload = self.host.peek(block_hash)
                if payload is None:
                    if block_hash not in pending:
                        break
                    payload = PendingSpill(pending[block_hash])
                found.append((block_hash, payload))
        return found

    def find_cached_prefix(self, request: CacheableRequest) -> PrefixHit:
        """Longest run of cached full blocks at the start of the request's tokens: the pool's, then the host
        tier's, then those its disk read brought (`disk_read_pending`)."""
        if not self.pool.enable_caching:
            return PrefixHit([], 0)
        blocks, rest = self._pool_prefix(request)
        loaded = self._host_prefix(rest)
        num_host = len(loaded)
        rest = rest[num_host:]
        read = self._disk_reads.get(request.request_id)
        if isinstance(read, dict):
            for block_hash in rest:
                payload = read.get(block_hash)
                if payload is None:
                    break
                loaded.append((block_hash, payload))
        return PrefixHit(blocks, (len(blocks) + len(loaded)) * self.block_size, loaded, num_host,
                         num_host + len(rest))

    def disk_read_pending(self, request: CacheableRequest) -> bool:
        """Whether the request waits for its prefix to be read from disk. The first call for a request whose
        prefix continues on disk past the pool's (and the host tier's) blocks starts the read (on the tier's
        reader thread) and answers True; later calls answer True until the blocks are in memory."""
        if self.disk is None:
            return False
        rid = request.request_id
        read = self._disk_reads.get(rid)
        if read is None:
            _, rest = self._pool_prefix(request)
            rest = rest[len(self._host_prefix(rest)):]
            if not rest or not self.disk.has(rest[0]):
                self._disk_reads[rid] = {}
                return False
            self.disk.read_ahead(rid, rest)
            self._disk_reads[rid] = _Reading(rest)
            return True
        if isinstance(read, _Reading):
            payloads = self.disk.take_read(rid)
            if payloads is None:
                return True
            self._disk_reads[rid] = dict(zip(read.hashes, payloads))  # up to the first block missing on disk
        return False

    def disk_reads_under_way(self) -> bool:
        """Whether a waiting request's disk read is under way (an engine with nothing to run waits for it)."""
        return any(isinstance(read, _Reading) for read in self._disk_reads.values())

    def allocate_slots(self, request: CacheableRequest, num_new_tokens: int,
                       prefix: PrefixHit | None = None) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens (after `prefix`, for a new request).

        Returns the newly allocated blocks, or None — changing nothing — when memory is full."""
        rid = request.request_id
        held = self.req_blocks.get(rid, [])
        shared = prefix.blocks if prefix else []
        if shared and held:
            raise RuntimeError(f"request {rid} already holds blocks; a prefix applies only at admission")
        num_tokens = self.req_num_tokens.get(rid, 0) + (prefix.num_tokens if prefix else 0) + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(held) - len(shared)
        # Shared blocks that are free now stop being allocatable once touched.
        num_revived = sum(1 for b in shared if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None
        if prefix is not None:  # admission: count the prefix-cache query once, when it succeeds
            self.prefix_queries_tokens += len(request.all_token_ids)
            self.prefix_hits_tokens += prefix.num_tokens
            self.host_hits_tokens += prefix.num_host_blocks * self.block_size
            self.disk_hits_tokens += prefix.num_disk_blocks * self.block_size
            past_host = prefix.num_past_pool_blocks - prefix.num_host_blocks
            if self.host is not None:
                self.host_misses_tokens += past_host * self.block_size
            if self.disk is not None:
                self.disk_misses_tokens += (past_host - prefix.num_disk_blocks) * self.block_size
            for block_hash, payload in prefix.loaded[:prefix.num_host_blocks]:
                if not isinstance(payload, PendingSpill):  # (a pending one never reaches the tier)
                    self.host.take(block_hash)  # back into the pool: one place for a block at a time
        self.pool.touch(shared)
        new_blocks = self.pool.allocate(max(num_needed, 0)) or []
        if prefix is not None and prefix.loaded:  # the first new blocks take the tiers' bytes
            for block, (block_hash, payload) in zip(new_blocks, prefix.loaded):
                self.pool.cache(block, block_hash)
                self._loads.append((block.block_id, payload))
            self.req_num_cached_blocks[rid] = len(shared) + len(prefix.loaded)
        if prefix is not None:
            self._disk_reads.pop(rid, None)  # admitted: a later admission (after a preemption) looks again
        self.req_blocks[rid] = held + shared + new_blocks
        ids = self.req_block_ids.setdefault(rid, [])
        ids.extend(b.block_id for b in shared)
        ids.extend(b.block_id for b in new_blocks)
        self.req_num_tokens[rid] = num_tokens
        return new_blocks

    def cache_full_blocks(self, request: CacheableRequest, num_computed_tokens: int) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        done = self.req_num_cached_blocks.get(rid, 0)  # blocks before this were registered already
        if num_full <= done:
            return
        hashes = self._hashes(request)
        for i in range(done, num_full):
            block = blocks[i]
            if block is not WINDOW_FREED and block.block_hash is None:
                self.pool.cache(block, hashes[i])
                if self.disk is not None and block.block_hash is not None:
                    self._written.append((block.block_id, block.block_hash))
        self.req_num_cached_blocks[rid] = num_full

    def take_spills(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the cached blocks the pool evicted since the last call (with a host tier): the
        engine copies their bytes to the host tier first thing before the step's forward, before the tiers'
        loads and the forward overwrite them."""
        spills = self.pool.spills
        if not spills:
            return []
        self.pool.spills = []
        return spills

    def take_loads(self) -> list[tuple[int, bytes | PendingSpill]]:
        """(block id, bytes) of the blocks taken from the host tier or read from disk since the last call: the
        engine copies them into the pool before the step's forward (the requests admitted with them count those
        tokens as computed). A `PendingSpill` instead of bytes: those of one of this step's spills (`take_spills`),
        which then does not go to the host tier."""
        loads, self._loads = self._loads, []
        return loads

    def take_written(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the blocks registered since the last call: after the step's forward has
        filled them, the engine copies their bytes out to the disk tier."""
        written, self._written = self._written, []
        return written

    def free_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """With a sliding window W (every layer windowed): the next position computed is at least
        `num_computed_tokens`, and it sees positions > num_computed_tokens - W; blocks wholly before
        that are returned to the pool (they keep their prefix-cache hash, so a later request with
        the same prefix can still revive them). A sequence then holds at most ceil(W / block_size)
        + 1 blocks while it decodes, however long it grows."""
        if self.sliding_window is None:
            return
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        first_needed = num_computed_tokens - self.sliding_window + 1
        num_dead = min(max(first_needed, 0) // self.block_size, len(blocks))
        done = self.req_num_window_freed.get(request_id, 0)
        if num_dead > done:
            self.pool.free(list(reversed(blocks[done:num_dead])))
            blocks[done:num_dead] = [WINDOW_FREED] * (num_dead - done)
            self.req_block_ids[request_id][done:num_dead] = [WINDOW_FREED.block_id] * (num_dead - done)
            self.req_num_window_freed[request_id] = num_dead

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep slots for the request's first `num_tokens` tokens only: rejected draft tokens give
        their slots back, and blocks holding nothing else return to the pool (never cached: only
        verified blocks are registered)."""
        held = self.req_num_tokens.get(request_id)
        if held is None or num_tokens >= held:
            return
        blocks = self.req_blocks[request_id]
        keep = -(-num_tokens // self.block_size)
        if keep < self.req_num_cached_blocks.get(request_id, 0):
            raise RuntimeError(f"request {request_id}: truncating into its registered prefix blocks")
        self.pool.free(list(reversed(blocks[keep:])))
        del blocks[keep:]
        # a new list, not a cut in place: a list cut back and grown again before the model runner
        # looks would keep its length, and the runner's persistent row would keep the old ids
        self.req_block_ids[request_id] = self.req_block_ids[request_id][:keep]
        self.req_num_tokens[request_id] = num_tokens

    def free(self, request_id: str) -> None:
        """Release every block the request holds (tail first, so its prefix outlives its tail)."""
        blocks = self.req_blocks.pop(request_id, [])
        self.req_block_ids.pop(request_id, None)
        self.pool.free([b for b in reversed(blocks) if b is not WINDOW_FREED])
        self.req_hashes.pop(request_id, None)
        self.req_num_tokens.pop(request_id, None)
        self.req_num_cached_blocks.pop(request_id, None)
        self.req_num_window_freed.pop(request_id, None)
        if self._disk_reads.pop(request_id, None) is not None and self.disk is not None:
            self.disk.forget_read(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block ids."""
        return list(self.req_block_ids.get(request_id, ()))

    def live_block_ids(self, request_id: str) -> list[int]:
        """The request's block-id list itself (O(1)): read it during the step it was scheduled
        for, never change it. It grows at its end, is cut back by `truncate`, has window-freed
        entries set to block 0, and is replaced by a new list when it is cut back (`truncate`) or the
        request is admitted again."""
        ids = self.req_block_ids.get(request_id)
        return ids if ids is not None else []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_owners(self) -> tuple[list[str | None], list[bool], list[bool]]:
        """Each block's state, for a picture of the pool: (the request holding it, or None; whether more than one
        request holds it (a shared prefix); whether a free block still holds a cached prefix)."""
        owners: list[str | None] = [None] * self.pool.num_blocks
        for rid, blocks in self.req_blocks.items():
            for block in blocks:
                if block is not WINDOW_FREED and owners[block.block_id] is None:
                    owners[block.block_id] = rid
        shared = [b.ref_cnt > 1 for b in self.pool.blocks]
        cached = [b.ref_cnt == 0 and b.block_hash is not None for b in self.pool.blocks]
        return owners, shared, cached

    def usage(self) -> KVCacheUsage:
        num_used = self.pool.num_blocks - self.pool.num_free_blocks
        # Slots filled, each used block counted once. A request's blocks hold exactly its tokens
        # (it has ceil(tokens / block_size) blocks); a block held by k requests is a full, shared
        # prefix block, counted k times in that sum: subtract the k - 1 extra copies.
        freed = self.req_num_window_freed
        tokens = sum(self.req_num_tokens[rid] - freed.get(rid, 0) * self.block_size for rid in self.req_blocks)
        references = sum(len(blocks) - freed.get(rid, 0) for rid, blocks in self.req_blocks.items())
        return KVCacheUsage(self.pool.num_blocks, num_used, self.pool.num_cached_free_blocks,
                            tokens - (references - num_used) * self.block_size, self.block_size)
