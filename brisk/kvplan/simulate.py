"""The comparison strategies of `brisk kv-plan`: KV allocators brisk does not use, simulated
step by step over a request trace. Pure Python, no torch. (brisk's own paged engine is not
simulated here: engine_sim.py runs its real scheduler and KV manager.)

Time advances in steps of `step_s` seconds (the generation speed) plus the prompt tokens the
step admits at `prefill_tps`. Each step first grows every running request by the token it
decodes (oldest first; when memory runs out the newest running request is preempted and
requeued first, to be recomputed), then admits waiting requests FCFS while memory,
`max_num_seqs` and the step's token budget allow; a prompt larger than the whole budget is
admitted alone (these allocators are compared on memory, not on chunked prefill). A request
admitted at step s holds its prompt, samples one token per step, and is freed at the end of
step s + output_tokens - 1 (its last sampled token is never written to the cache). Memory is
recorded as held during each step; means are over all steps.

Strategies differ only in what a request holds:
- `static`: a contiguous region of max_model_len tokens (a naive static cache);
- `reserve`: a contiguous region of prompt + max_tokens;
- `buckets`: a slot in the smallest pool whose slot size fits prompt + max_tokens (the
  article's bucketed pools), optionally rebalanced every N steps.
Contiguous strategies use a first-fit allocator over one address range, so external
fragmentation (free memory split into holes too small to use) is real, not assumed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from brisk.trace import TraceRequest


@dataclass
class SimConfig:
    capacity_tokens: int  # KV memory budget in tokens
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_s: float = 0.05  # seconds per engine step (1 / per-sequence decode speed)
    prefill_tps: float = math.inf  # prompt tokens prefilled per second: a step takes step_s + prefill / this
    default_max_tokens: int | None = None  # when the trace has no max_tokens: max_model_len - prompt
    max_steps: int = 2_000_000


@dataclass
class _Seq:
    index: int
    req: TraceRequest
    arrival_t: float  # seconds (or a step index, with arrival_steps)
    max_tokens: int
    sampled: int = 0  # tokens sampled so far (survives preemption: recomputed, not lost)
    held: int = 0  # tokens with KV slots now
    admitted_step: int | None = None

    @property
    def need_on_admit(self) -> int:
        return self.req.prompt_tokens + self.sampled


class Allocator(Protocol):
    def admit(self, s: _Seq, tokens: int) -> bool: ...
    def grow(self, s: _Seq, tokens: int) -> bool: ...
    def release(self, s: _Seq) -> None: ...
    def allocated(self) -> int: ...  # tokens of memory held (reserved regions / blocks / slots)
    def used(self) -> int: ...  # tokens of K/V actually stored (a shared prefix counts once)
    def reserved_unused(self) -> int: ...  # held for future tokens of a reservation
    def fits_ignoring_layout(self, s: _Seq) -> bool: ...  # enough free memory in total
    def ever_fits(self, s: _Seq) -> bool: ...  # fits an empty cache at all


# -- contiguous (first-fit) -------------------------------------------------------------------------
class ContiguousAllocator:
    def __init__(self, capacity: int, reservation):
        self.capacity = capacity
        self.reservation = reservation  # _Seq -> tokens to reserve
        self.regions: dict[int, tuple[int, int]] = {}  # seq index -> (start, size)
        self.tokens: dict[int, int] = {}

    def _first_fit(self, size: int) -> int | None:
        pos = 0
        for start, length in sorted(self.regions.values()):
            if start - pos >= size:
                return pos
            pos = max(pos, start + length)
        return pos if self.capacity - pos >= size else None

    def admit(self, s: _Seq, tokens: int) -> bool:
        size = self.reservation(s)
        start = self._first_fit(size)
        if start is None:
            return False
        self.regions[s.index] = (start, size)
        self.tokens[s.index] = tokens
        return True

    def grow(self, s: _Seq, tokens: int) -> bool:
        if tokens > self.regions[s.index][1]:
            return False  # cannot happen: a reservation covers prompt + max_tokens
        self.tokens[s.index] = tokens
        return True

    def release(self, s: _Seq) -> None:
        self.regions.pop(s.index, None)
        self.tokens.pop(s.index, None)

    def allocated(self) -> int:
        return sum(size for _, size in self.regions.values())

    def used(self) -> int:
        return sum(self.tokens.values())

    def reserved_unused(self) -> int:
        return self.allocated() - self.used()

    def fits_ignoring_layout(self, s: _Seq) -> bool:
        return self.capacity - self.allocated() >= self.reservation(s)

    def ever_fits(self, s: _Seq) -> bool:
        return self.reservation(s) <= self.capacity


# -- bucketed pools ---------------------------------------------------------------------------------
class BucketAllocator:
    def __init__(self, capacity: int, sizes: list[int], shares: list[float], rebalance_every: int | None = None):
        if len(sizes) != len(shares) or not sizes:
            raise ValueError("buckets need one share per size")
        order = sorted(range(len(sizes)), key=lambda i: sizes[i])
        self.sizes = [sizes[i] for i in order]
        total = sum(shares)
        self.capacity = capacity
        self.slots = [int(shares[i] / total * capacity // sizes[i]) for i in order]
        self.used_slots = [0] * len(self.sizes)
        self.where: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.need: dict[int, int] = {}
        self.rebalance_every = rebalance_every
        self.num_rebalances = 0

    def _need(self, s: _Seq) -> int:
        return s.req.prompt_tokens + s.max_tokens

    def admit(self, s: _Seq, tokens: int) -> bool:
        need = self._need(s)
        for k, size in enumerate(self.sizes):  # smallest fitting bucket first, spill to larger ones
            if size >= need and self.used_slots[k] < self.slots[k]:
                self.used_slots[k] += 1
                self.where[s.index], self.tokens[s.index], self.need[s.index] = k, tokens, need
                return True
        return False

    def grow(self, s: _Seq, tokens: int) -> bool:
        if tokens > self.sizes[self.where[s.index]]:
            return False
        self.tokens[s.index] = tokens
        return True

    def release(self, s: _Seq) -> None:
        k = self.where.pop(s.index, None)
        if k is not None:
            self.used_slots[k] -= 1
            self.tokens.pop(s.index)
            self.need.pop(s.index)

    def allocated(self) -> int:
        return sum(self.sizes[k] for k in self.where.values())

    def used(self) -> int:
        return sum(self.tokens.values())

    def reserved_unused(self) -> int:
        return sum(self.need[i] - self.tokens[i] for i in self.where)

    def internal(self) -> int:
        return sum(self.sizes[k] - self.need[i] for i, k in self.where.items())

    def fits_ignoring_layout(self, s: _Seq) -> bool:
        free = self.capacity - sum(u * size for u, size in zip(self.used_slots, self.sizes))
        return free >= self._need(s) and self._need(s) <= self.sizes[-1]

    def ever_fits(self, s: _Seq) -> bool:
        return self._need(s) <= self.sizes[-1]

    def rebalance(self, waiting: list[_Seq]) -> None:
        """Re-cut the free memory into slots where the demand is (used + waiting per bucket)."""
        demand = [self.used_slots[k] + 1 for k in range(len(self.sizes))]
        for s in waiting:
            k = next((k for k, size in enumerate(self.sizes) if size >= self._need(s)), None)
            if k is not None:
                demand[k] += 1
        weight = [d * size for d, size in zip(demand, self.sizes)]
        free = self.capacity - sum(u * size for u, size in zip(self.used_slots, self.sizes))
        new = [u + int(free * w / sum(weight) // size)
               for u, w, size in zip(self.used_slots, weight, self.sizes)]
        if new != self.slots:
            self.slots = new
            self.num_rebalances += 1


# -- the step loop ----------------------------------------------------------------------------------
@dataclass
class SimResult:
    strategy: str
    steps: int
    step_s: float
    capacity_tokens: int
    peak_allocated: int
    mean_allocated: float
    mean_used: float
    mean_internal: float
    mean_reserved_unused: float
    mean_external: float
    peak_running: int
    mean_running: float
    num_finished: int
    num_rejected: int
    num_preemptions: int
    admission_delays_s: list[float]
    timeline: dict[str, list[float]] = field(default_factory=dict)  # per step, during it: allocated, used, running
    used_blocks: list[int] = field(default_factory=list)  # brisk's engine only: blocks held after each step
    prefix_hit_tokens: int = 0  # brisk's engine only: prompt tokens served from the prefix cache
    serve_flags: str | None = None  # brisk's engine only: the brisk serve flags simulated

    def to_dict(self) -> dict:
        def frac(x):
            return x / self.capacity_tokens if self.capacity_tokens else 0.0

        delays = sorted(self.admission_delays_s)
        pct = (lambda q: delays[min(len(delays) - 1, int(q * len(delays)))] if delays else 0.0)
        return {
            "strategy": self.strategy, "steps": self.steps, "duration_s": self.steps * self.step_s,
            "capacity_tokens": self.capacity_tokens, "peak_allocated_tokens": self.peak_allocated,
            "mean_allocated_tokens": self.mean_allocated, "mean_used_tokens": self.mean_used,
            "waste": {"internal_fragmentation": frac(self.mean_internal),
                      "reservation": frac(self.mean_reserved_unused),
                      "external_fragmentation": frac(self.mean_external)},
            "peak_concurrent_sequences": self.peak_running, "mean_concurrent_sequences": self.mean_running,
            "finished": self.num_finished, "rejected": self.num_rejected, "preemptions": self.num_preemptions,
            "admission_delay_s": {"mean": sum(delays) / len(delays) if delays else 0.0, "p50": pct(0.5),
                                  "p99": pct(0.99)},
            **({"brisk_serve_flags": self.serve_flags, "peak_blocks": max(self.used_blocks, default=0),
                "prefix_hit_tokens": self.prefix_hit_tokens} if self.serve_flags else {}),
        }


def simulate(trace: list[TraceRequest], alloc: Allocator, cfg: SimConfig, strategy: str,
             arrival_steps: list[int] | None = None, rebalance_every: int | None = None) -> SimResult:
    seqs = []
    for i, r in enumerate(trace):
        max_tokens = r.max_tokens or cfg.default_max_tokens or max(cfg.max_model_len - r.prompt_tokens, 1)
        when = float(arrival_steps[i]) if arrival_steps is not None else r.arrival_s
        seqs.append(_Seq(i, r, when, max(max_tokens, r.output_tokens)))
    pending = deque(sorted(seqs, key=lambda s: (s.arrival_t, s.index)))
    waiting: deque[_Seq] = deque()
    running: list[_Seq] = []
    stats = Accumulator(cfg.capacity_tokens)
    rejected = preemptions = finished = 0
    delays: list[float] = []
    step, clock = 0, 0.0

    def now() -> float:  # what arrivals are compared with
        return float(step) if arrival_steps is not None else clock + 1e-9

    while (pending or waiting or running) and step < cfg.max_steps:
        while pending and pending[0].arrival_t <= now():
            s = pending.popleft()
            if s.req.prompt_tokens + s.req.output_tokens > cfg.max_model_len or not alloc.ever_fits(s):
                rejected += 1
                continue
            waiting.append(s)
        if rebalance_every and isinstance(alloc, BucketAllocator) and step % rebalance_every == 0:
            alloc.rebalance(list(waiting))
        preempted = _grow_running(alloc, running, waiting)
        preemptions += preempted
        budget = full_budget = cfg.max_num_batched_tokens - len(running)
        prefilled = 0
        blocked = None  # the queue head, when memory (not seats or budget) kept it waiting
        if not preempted:
            while waiting and len(running) < cfg.max_num_seqs:
                s = waiting[0]
                need = s.need_on_admit
                if need > budget and budget < full_budget:
                    break  # (a prompt over the whole budget is admitted alone: no chunking modelled here)
                if not alloc.admit(s, need):
                    blocked = s
                    break
                waiting.popleft()
                budget -= need
                prefilled += need
                s.held = need
                if s.admitted_step is None:
                    delays.append(_delay(s, step, clock, arrival_steps, cfg))
                s.admitted_step = step
                running.append(s)
        if not running and blocked is not None and not _retry_after_rebalance(alloc, blocked, waiting, rebalance_every):
            # an empty system cannot take it: it never will (e.g. a bucket class with no slots)
            waiting.popleft()
            rejected += 1
            blocked = None
        elif not running and blocked is not None:  # the rebalance made room: admit it now
            s = waiting.popleft()
            s.held = s.need_on_admit
            prefilled += s.held
            delays.append(_delay(s, step, clock, arrival_steps, cfg))
            s.admitted_step = step
            running.append(s)
            blocked = None
        for s in running:
            s.sampled += 1
        external = 0  # free memory that exists but cannot take the blocked request
        if blocked is not None and alloc.fits_ignoring_layout(blocked):
            external = cfg.capacity_tokens - alloc.allocated()
        stats.record(alloc, len(running), external)  # memory held during the step
        stats.timeline["t"].append(clock)
        done = [s for s in running if s.sampled >= s.req.output_tokens]
        for s in done:
            running.remove(s)
            alloc.release(s)
            finished += 1
        step += 1
        clock += cfg.step_s + prefilled / cfg.prefill_tps
    return stats.result(strategy, step, clock / max(step, 1), cfg.capacity_tokens, finished, rejected, preemptions,
                        delays)


def _delay(s: _Seq, step: int, clock: float, arrival_steps, cfg: SimConfig) -> float:
    """Seconds from arrival to admission (steps × step_s when arrivals are step indices)."""
    return (step - s.arrival_t) * cfg.step_s if arrival_steps is not None else max(clock - s.arrival_t, 0.0)


def _retry_after_rebalance(alloc: Allocator, s: _Seq, waiting, rebalance_every: int | None) -> bool:
    if not (rebalance_every and isinstance(alloc, BucketAllocator)):
        return False
    alloc.rebalance(list(waiting))
    return alloc.admit(s, s.need_on_admit)


def _grow_running(alloc: Allocator, running: list[_Seq], waiting: deque) -> int:
    """Each running request needs a slot for the token it decodes; preempt the newest on failure."""
    preempted = 0
    for s in list(running):
        if s not in running:
            continue
        while not alloc.grow(s, s.held + 1):
            victim = running.pop()
            alloc.release(victim)
            victim.held = 0
            waiting.appendleft(victim)
            preempted += 1
            if victim is s:
                break
        else:
            s.held += 1
    return preempted


class Accumulator:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.n = 0
        self.sums = {"allocated": 0.0, "used": 0.0, "internal": 0.0, "reserved": 0.0, "external": 0.0,
                     "running": 0.0}
        self.peak_allocated = 0
        self.peak_running = 0
        self.timeline: dict[str, list[float]] = {"allocated": [], "used": [], "running": [], "t": []}
        self.used_blocks: list[int] = []

    def record(self, alloc: Allocator, running: int, external: int) -> None:
        allocated, used = alloc.allocated(), alloc.used()
        reserved = alloc.reserved_unused()
        internal = alloc.internal() if isinstance(alloc, BucketAllocator) else allocated - used - reserved
        self.timeline["allocated"].append(allocated)
        self.timeline["used"].append(used)
        self.timeline["running"].append(running)
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_running = max(self.peak_running, running)
        self.n += 1
        for key, value in (("allocated", allocated), ("used", used), ("internal", internal),
                           ("reserved", reserved), ("external", external), ("running", running)):
            self.sums[key] += value

    def result(self, strategy, steps, step_s, capacity_tokens, finished, rejected, preemptions,
               delays) -> SimResult:
        n = max(self.n, 1)
        m = {k: v / n for k, v in self.sums.items()}
        return SimResult(strategy, steps, step_s, capacity_tokens, self.peak_allocated, m["allocated"],
                         m["used"], m["internal"], m["reserved"], m["external"], self.peak_running, m["running"],
                         finished, rejected, preemptions, delays, self.timeline, self.used_blocks)
