"""Prefix affinity: which replica last served which prompt prefix, and where the next request goes.

Ray-free and torch-free, so the policy is tested without a cluster. The keys are the engine's own
prefix-cache keys (`brisk.engine.kv_cache.hashing`: chained hashes of full KV blocks), computed by
the ingress from the templated prompt, so "same key" means "that replica's prefix cache may hold
these blocks". The router learns only from its own decisions: after it sends a request to a
replica it records the request's block hashes against that replica (`record`). It never asks the
replicas what they still hold, so an entry can outlive the replica's eviction of those blocks;
that costs one missed hit, never a wrong answer (the engine looks its cache up again).

A prefix that every recent request shares (the chat template's header and the model's default
system prompt, which every chat carries) is no affinity: following it would send every new
conversation to the replica that served the first one (measured: 7 chats, 4 at once, all on one
of two replicas). The policy remembers the last `window` requests' hashes; a request's match
counts only past the longest prefix it shares with all of them.

State is bounded: at most `max_entries` hashes (LRU; a hit refreshes every block of the prefix),
each mapped to one replica id. With the default 65,536 entries and 16-token blocks that is
about a million prompt tokens of history, ~10 MB.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

DEFAULT_MAX_ENTRIES = 65_536
DEFAULT_MAX_IMBALANCE = 4  # ongoing requests the affine replica may have beyond the least-loaded one
# A match shorter than this share of the prompt's blocks is no affinity: every chat prompt shares its
# template's first block, and following that would pile every new prompt onto one replica.
DEFAULT_MIN_MATCH = 0.1
DEFAULT_WINDOW = 32  # recent requests whose common prefix is discounted


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str  # "prefix" (affinity hit) or "load" (power of two choices on queue length)
    matched_blocks: int = 0


class PrefixAffinity:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                 rng: random.Random | None = None, min_match: float = DEFAULT_MIN_MATCH,
                 window: int = DEFAULT_WINDOW):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.max_entries = max_entries
        self.max_imbalance = max_imbalance
        self.min_match = min_match
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> replica id, LRU order
        self.owned: dict[str, int] = {}  # replica id -> blocks recorded against it
        self._rng = rng or random.Random()
        self._recent: deque[tuple[bytes, ...]] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._owner)

    def lookup(self, hashes: Sequence[bytes], replicas: Sequence[str]) -> tuple[str | None, int]:
        """(the replica holding the longest recorded prefix of `hashes` among `replicas`, its length in
        blocks). Hashes are chained, so the deepest hash that has an owner identifies the prefix."""
        live = set(replicas)
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None and owner in live:
                return owner, depth
        return None, 0

    def shared_depth(self, hashes: Sequence[bytes]) -> int:
        """Blocks of `hashes` that every one of the recent requests also starts with (0 before any)."""
        shared = len(hashes)
        for other in self._recent:
            shared = min(shared, _common_depth(hashes, other))
            if shared == 0:
                break
        return shared if self._recent else 0

    def choose(self, hashes: Sequence[bytes], queue_lens: dict[str, int]) -> Decision:
        """`queue_lens`: ongoing requests per candidate replica. The affine replica (holding at least
        `min_match` of the prompt's blocks, and more than the prefix every recent request shares)
        wins unless it has
        more than `max_imbalance` requests beyond the least-loaded candidate; then power of two
        choices (the shorter queue of two random candidates). A prefix nobody holds goes to the
        replica holding the fewest recorded blocks among those within `max_imbalance` of the least
        loaded (ties: power of two choices), so the prompt set's KV spreads evenly over the pools
        instead of piling onto one and thrashing its LRU (measured: benchmarks/scale_out.py)."""
        if not queue_lens:
            raise ValueError("no replica to choose from")
        owner, depth = self.lookup(hashes, list(queue_lens))
        shared = self.shared_depth(hashes)
        self._recent.append(tuple(hashes))
        if depth <= shared or depth < self.min_match * len(hashes):
            owner, depth = None, 0  # only what every prompt has in common: a new prefix
        least = min(queue_lens.values())
        if owner is not None and queue_lens[owner] - least <= self.max_imbalance:
            return Decision(owner, "prefix", depth)
        if owner is None:  # a new prefix: to the replica holding the fewest blocks among those not overloaded
            fit = [r for r in sorted(queue_lens) if queue_lens[r] - least <= self.max_imbalance]
            fewest = min(self.owned.get(r, 0) for r in fit)
            fit = [r for r in fit if self.owned.get(r, 0) == fewest]
        else:  # the affine replica is overloaded: power of two choices among all
            fit = sorted(queue_lens)
        pair = self._rng.sample(fit, 2) if len(fit) > 1 else fit
        return Decision(min(pair, key=lambda r: queue_lens[r]), "load")

    def record(self, hashes: Sequence[bytes], replica: str) -> None:
        """`replica` now holds (or is computing) these blocks."""
        for h in hashes:
            previous = self._owner.get(h)
            if previous != replica:
                if previous is not None:
                    self._disown(previous)
                self.owned[replica] = self.owned.get(replica, 0) + 1
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            _, evicted = self._owner.popitem(last=False)
            self._disown(evicted)

    def forget(self, replica: str) -> None:
        """A replica died or was scaled away: its cache is gone."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
        self.owned.pop(replica, None)

    def _disown(self, replica: str) -> None:
        left = self.owned.get(replica, 0) - 1
        if left > 0:
            self.owned[replica] = left
        else:
            self.owned.pop(replica, None)


def _common_depth(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading blocks two hash chains share. Chained hashes agree at depth d only if they
    agree at every depth below it, so a binary search finds it."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
