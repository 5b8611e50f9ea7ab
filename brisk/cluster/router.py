"""Ray Serve request router for brisk's engine replicas: prefix affinity, then load.

It runs inside the caller of the engine deployment's handle (the ingress), once per handle.
Requests carry what it needs as keyword arguments of the handle call:

- `prefix_hashes`: the prompt's full-block hashes (the engine's prefix-cache keys). The policy is
  `brisk.cluster.affinity.PrefixAffinity`: the replica that last got the longest of these prefixes,
  unless its queue is longer than the least-loaded replica's by more than `max_imbalance`; otherwise
  power of two choices on queue length. Queue lengths are Serve's own (ongoing requests per replica,
  from its cache, probed when missing or stale).
- `brisk_replica`: a replica id; the call goes to exactly that replica (the ingress uses it to
  scrape every replica's engine metrics).

Calls without either (model info, health) take power of two choices.

`PowerOfTwoRouter` is Ray Serve's default router (power of two choices, no affinity) plus the same
pinning, so /metrics works with it too: `--request-router pow2`, the baseline of
benchmarks/scale_out.py.

Ray Serve ships this module to the handle's process by value: keep no state at module level here
(brisk.cluster.registry holds the process's routers).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import List, Optional

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from brisk.cluster import registry
from brisk.cluster.affinity import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_IMBALANCE, PrefixAffinity


def _pinned(candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest]):
    """The candidates a `brisk_replica`-pinned call may go to, or None for an unpinned call."""
    target = pending_request.kwargs.get("brisk_replica") if pending_request is not None else None
    if target is None:
        return None
    return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]


class PowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **_ignored):
        self.decisions: Counter = Counter({"prefix": 0, "load": 0})
        registry.register(self)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        if pending_request is not None and "prefix_hashes" in pending_request.kwargs:
            self.decisions["load"] += 1
        return await super().choose_replicas(candidate_replicas, pending_request)


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                         max_imbalance: int = DEFAULT_MAX_IMBALANCE, **_ignored):
        self.affinity = PrefixAffinity(max_entries, max_imbalance)
        self.decisions: Counter = Counter({"prefix": 0, "load": 0})
        registry.register(self)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        hashes = pending_request.kwargs.get("prefix_hashes") if pending_request is not None else None
        if hashes is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        decision = self.affinity.choose(hashes, await self._queue_lens(candidate_replicas))
        self.decisions[decision.reason] += 1
        self.affinity.record(hashes, decision.replica)
        return [[by_id[decision.replica]]]

    async def _queue_lens(self, replicas: List[RunningReplica]) -> dict[str, int]:
        lens: dict[str, int] = {}
        missing = []
        for r in replicas:
            cached = self.replica_queue_len_cache.get(r.replica_id)
            if cached is None:
                missing.append(r)
            else:
                lens[r.replica_id.unique_id] = cached
        if missing:
            for r, queue_len in await self._probe_queue_lens(missing, 0):
                if queue_len is not None:
                    lens[r.replica_id.unique_id] = queue_len
        if not lens:  # no replica answered the probe: treat all as equal, Serve retries a refusal
            lens = {r.replica_id.unique_id: 0 for r in replicas}
        return lens

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)
