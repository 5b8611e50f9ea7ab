"""When to speculate (pure Python). Two rules, both measured in benchmarks/speculative.py:

- Load: while more than `disable_by_batch_size` requests are running, nobody drafts. A decode step
  over many rows already reads the weights once for all of them; k more tokens per row then add
  compute without saving a weight read.
- Acceptance: each request keeps an exponential moving average (weight 0.3) of the fraction of its
  drafted tokens the target accepted, starting at 1. When it falls below `min_acceptance_rate`
  the request stops drafting for a cool-down of 16 decode steps, doubled on each repeat (at most
  256), then tries again with the average reset to 0.5. A request whose text stops following its
  prompt so wastes little, and one that starts quoting again gets speculation back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from brisk.engine.spec_decode.ngram import NgramIndex

EMA_WEIGHT = 0.3
FIRST_COOLDOWN, MAX_COOLDOWN = 16, 256


@dataclass
class SpecState:
    """One request's speculation state."""

    index: NgramIndex | None = None  # the n-gram proposer's index of the sequence
    num_drafted: int = 0
    num_accepted: int = 0
    ema: float = 1.0
    cooldown_left: int = 0
    next_cooldown: int = FIRST_COOLDOWN
    # a draft model's: positions whose K/V its cache holds, the preemption count it was computed
    # under (a preempted request's blocks are gone), and this step's draft distributions [k, vocab]
    draft_computed: int = 0
    preemptions_seen: int = 0
    draft_probs: Any = None

    def ready(self) -> bool:
        """Whether this step may draft (counts down a cool-down)."""
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            if self.cooldown_left == 0:
                self.ema = 0.5
            return False
        return True

    def record(self, drafted: int, accepted: int, min_rate: float) -> None:
        if drafted <= 0:
            return
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.ema = (1 - EMA_WEIGHT) * self.ema + EMA_WEIGHT * accepted / drafted
        if self.ema < min_rate:
            self.cooldown_left = self.next_cooldown
            self.next_cooldown = min(2 * self.next_cooldown, MAX_COOLDOWN)
