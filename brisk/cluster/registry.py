"""The request routers living in this process (the ingress has one per engine handle), for the
ingress's /metrics and its list of replicas to scrape.

A module of its own because Ray Serve ships the router class to the handle's process by value
(cloudpickle): module state kept beside the class would be a copy; this module is imported by
reference everywhere.
"""

from __future__ import annotations

from collections import Counter

ROUTERS: list = []  # brisk.cluster.router.PrefixAffinityRouter instances


def register(router) -> None:
    ROUTERS.append(router)


def decisions() -> Counter:
    """Routing decisions of every router in this process, by reason ("prefix" or "load")."""
    total: Counter = Counter({"prefix": 0, "load": 0})
    for router in list(ROUTERS):
        total.update(router.decisions)
    return total


def replica_ids() -> list[str]:
    """The running replicas the routers of this process know of."""
    seen: dict[str, None] = {}
    for router in list(ROUTERS):
        for rid in list(router.curr_replicas):
            seen[rid.unique_id] = None
    return list(seen)
