"""The doctor's time budget: every probe runs under what is left of it, and what did not fit is
listed as skipped, never silently dropped and never reported as fine.

A fixed budget (`--quick`) runs its plan whole every time: no probe is left out because an
earlier one was slow (a report must not change from run to run with the machine's load); its
probes are sized to fit, and the budget only bounds each request's wait."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Budget:
    total_s: float
    start: float = field(default_factory=time.monotonic)
    skipped: list[str] = field(default_factory=list)
    fixed: bool = False  # the plan runs whole: fits() is always true

    def remaining(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def share_of_remaining(self, fraction: float) -> "Budget":
        """A budget for one check: `fraction` of what is left now (skips are recorded here too)."""
        return Budget(max(self.remaining() * fraction, 0.0), skipped=self.skipped, fixed=self.fixed)

    def fits(self, estimate_s: float, what: str) -> bool:
        """Whether a probe estimated at `estimate_s` fits; if not, it is recorded as skipped."""
        if self.fixed or estimate_s <= self.remaining():
            return True
        self.skipped.append(f"{what} (needs ~{estimate_s:.0f} s, {max(self.remaining(), 0):.0f} s left)")
        return False

    def timeout(self, floor_s: float = 0.5) -> float:
        """Timeout for the next request: what is left, at least `floor_s`."""
        return max(self.remaining(), floor_s)
