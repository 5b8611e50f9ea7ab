"""Text helpers shared by readers of a reply as it streams (stop strings, harmony's markup): no dependencies."""

from __future__ import annotations

from typing import Iterable


def held_back_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into one of `markers` (a stop string,
    a format's markup): that much is held back until the next text says which it is."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
