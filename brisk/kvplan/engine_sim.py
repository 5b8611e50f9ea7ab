"""brisk's own paged engine, on a simulated clock: the real `Scheduler` and `KVCacheManager`
(both torch-free) schedule a trace, and a cost model stands in for the forward pass.

So the plan is what `brisk serve` would do with the same flags: chunked prefill under the
step's token budget, admission in FCFS order, preemption of the newest request when blocks
run out, prefix sharing through the real block hashes. Requests carry synthetic token ids:
the `prefix_tokens` of a `prefix_group` are the same ids in every request of the group, every
other token is unique, so the prefix cache hits exactly where a real workload's would.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from brisk.engine.kv_cache.manager import KVCacheManager
from brisk.engine.request import Request, RequestStatus
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import Scheduler, SchedulerConfig
from brisk.kvplan.simulate import SimResult, Accumulator
from brisk.trace import TraceRequest


@dataclass(frozen=True)
class StepCost:
    """Seconds one engine step takes: a fixed decode step (1 / per-sequence decode speed) plus
    the prompt tokens it prefills at `prefill_tps`. Measure both on your server: `brisk bench`
    gives TPOT (the step) and `brisk doctor` the prefill cost per 1k tokens."""

    decode_step_s: float = 0.05
    prefill_tps: float = 2000.0

    def seconds(self, num_prefill_tokens: int) -> float:
        return self.decode_step_s + num_prefill_tokens / self.prefill_tps


@dataclass(frozen=True)
class EngineSimConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    max_steps: int = 2_000_000


class _Paged:
    """The allocator view `Accumulator` records: what the real KV manager holds (read once a step)."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.usage = kv.usage()

    def refresh(self) -> "_Paged":
        self.usage = self.kv.usage()
        return self

    def allocated(self) -> int:
        return self.usage.num_used_blocks * self.usage.block_size

    def used(self) -> int:
        return self.usage.num_used_slots

    def reserved_unused(self) -> int:
        return 0


def simulate_engine(trace: list[TraceRequest], cfg: EngineSimConfig, cost: StepCost, strategy: str,
                    arrival_steps: list[int] | None = None) -> SimResult:
    """Run the trace through brisk's scheduler. With `arrival_steps`, request i is added before
    step arrival_steps[i] (no clock; for comparing with a real engine stepped by hand)."""
    sched_cfg = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len)
    kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    scheduler = Scheduler(sched_cfg, kv)
    fresh = itertools.count(1_000_000)  # token ids no prefix shares
    prefixes: dict[str, list[int]] = {}
    order = sorted(range(len(trace)), key=lambda i: (arrival_steps[i] if arrival_steps else trace[i].arrival_s, i))
    pending = list(order)
    targets: dict[str, int] = {}
    arrived_at: dict[str, float] = {}
    first_at: dict[str, float] = {}
    stats = Accumulator(cfg.num_blocks * cfg.block_size)
    view = _Paged(kv)
    rejected = finished = 0
    clock, step = 0.0, 0

    def arrived(i: int) -> bool:
        return arrival_steps[i] <= step if arrival_steps is not None else trace[i].arrival_s <= clock + 1e-9

    while (pending or scheduler.has_unfinished) and step < cfg.max_steps:
        while pending and arrived(pending[0]):
            i = pending.pop(0)
            r = trace[i]
            if r.prompt_tokens + r.output_tokens > cfg.max_model_len:
                rejected += 1  # brisk answers 400: prompt + output over the window
                continue
            head = []
            if r.prefix_group is not None and r.prefix_tokens:
                group = prefixes.setdefault(r.prefix_group, [])
                while len(group) < r.prefix_tokens:
                    group.append(next(fresh))
                head = group[:min(r.prefix_tokens, r.prompt_tokens)]
            ids = head + [next(fresh) for _ in range(r.prompt_tokens - len(head))]
            request = Request(f"r{i}", ids, SamplingParams(max_tokens=r.output_tokens, ignore_eos=True))
            scheduler.add_request(request)
            targets[request.request_id] = r.output_tokens
            arrived_at[request.request_id] = clock
        out = scheduler.schedule()
        for chunk in out.chunks:
            first_at.setdefault(chunk.request.request_id, clock)
        prefill_tokens = sum(c.num_tokens for c in out.chunks
                             if not (c.num_tokens == 1 and c.request.num_output_tokens))
        stats.record(view.refresh(), len(scheduler.running), 0)  # memory held during the step (0 when idle)
        stats.timeline["t"].append(clock)
        for request in scheduler.advance(out):
            request.append_output(next(fresh))
            if request.num_output_tokens >= targets[request.request_id] or \
                    request.num_tokens >= cfg.max_model_len:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                finished += 1
        stats.used_blocks.append(cfg.num_blocks - kv.num_free_blocks)  # after the step, as the engine reports it
        clock += cost.seconds(prefill_tokens)  # an idle loop turn: time passes by one step
        step += 1
    delays = [first_at[rid] - arrived_at[rid] for rid in first_at]
    result = stats.result(strategy, step, clock / max(step, 1), cfg.num_blocks * cfg.block_size, finished,
                          rejected, scheduler.num_preemptions, delays)
    result.prefix_hit_tokens = kv.prefix_hits_tokens
    return result
