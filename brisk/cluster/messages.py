"""What a replica tells the ingress about one request besides its outputs: typed, so both sides
name the same cases (they cross Ray's object store and the TCP output channel pickled; this module
is importable on both ends, and imports nothing heavy).

A replica's `generate` stream (brisk/cluster/replica.py) starts with `Accepted`, or ends at once
with `Invalid` (a parameter the engine refuses: a 400 naming `field`), `EngineDead` or
`ChannelLost`. Then lists of RequestOutputs follow, ending with the finished one, or with an
`EngineDead` / `ChannelLost` if the request could not finish.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accepted:
    """The replica's engine took the request; its outputs follow."""


@dataclass(frozen=True)
class Invalid:
    """The engine refused a parameter (an HTTP 400 on the ingress); `field` names it when known."""
    message: str
    field: str | None = None


@dataclass(frozen=True)
class EngineDead:
    """The replica's engine loop stopped: the request cannot continue there."""
    message: str


@dataclass(frozen=True)
class ChannelLost:
    """The replica cannot reach (or lost) the ingress's output channel."""
    message: str


Failure = EngineDead | ChannelLost  # how a stream of outputs can end early
