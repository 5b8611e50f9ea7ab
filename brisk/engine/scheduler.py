"""Token-budget scheduler (pure Python, no torch).

There is no prefill phase and no decode phase: every request has
`num_computed_tokens` and `num_tokens`, and each step hands out a token budget so
requests catch up. Running requests go first (a decode needs one token, an
unfinished prompt gets the next chunk), then waiting requests are admitted while
budget, sequence slots and KV blocks last. So a long prompt is prefilled in chunks
between other streams' decode steps instead of stalling them. A waiting request whose
cached prefix is being read from the KV disk tier is passed over until its blocks are in
memory; the requests behind it are admitted meanwhile.

When KV blocks run out, the newest running request is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed later. The
oldest request can therefore always make progress: no deadlock, no starvation.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from brisk.engine.kv_cache.manager import KVCacheManager, PrefixHit
from brisk.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens
    block_ids: list[int]  # the KV manager's live list (live_block_ids): read it this step only
    # of which the last `num_draft` are speculative (request.spec_token_ids[:num_draft]): the
    # target verifies them, and only accepted ones become part of the sequence
    num_draft: int = 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by (priority, arrival_seq)
        self.running: list[Request] = []  # admission order: last is newest
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.arrival_seq = next(self._arrivals)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        keys = [(r.priority, r.arrival_seq) for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, (request.priority, request.arrival_seq)), request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free every block it holds."""
        if request.status.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.times.finished_ts = time.monotonic()
        self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._admit_waiting(out, budget)
        now = time.monotonic()
        for chunk in out.chunks:
            if chunk.request.times.first_scheduled_ts is None:
                chunk.request.times.first_scheduled_ts = now
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # drafted tokens ride on a decode step and count against the token budget
            num_draft = min(len(request.spec_token_ids), budget - 1) if num_new == 1 else 0
            if num_draft and self.kv.allocate_slots(request, num_new + num_draft) is None:
                num_draft = 0  # memory is short: drop the draft before preempting anybody
            while not num_draft and self.kv.allocate_slots(request, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    num_new = 0
                    break
            if num_new:
                self._schedule_chunk(request, num_new, out, num_draft)
                budget -= num_new + num_draft
        return budget

    def _schedule_chunk(self, request: Request, num_new: int, out: SchedulerOutput, num_draft: int = 0) -> None:
        out.chunks.append(ScheduledChunk(request, num_new + num_draft, self.kv.live_block_ids(request.request_id),
                                         num_draft))
        # NOTE: blocks this chunk fills are registered now, not after the forward: a request
        # admitted later in this same step may share them, because every layer writes the
        # step's K/V before any sequence attends. A burst of requests with one system prompt
        # then computes it once. (A request registered this step is never preempted in it:
        # preemption only takes the newest running request not yet scheduled.) Drafted positions
        # are never registered: a block holding an unverified token must not be shared.
        self.kv.cache_full_blocks(request, request.num_computed_tokens + num_new)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            if not request.reads_every_position and self.kv.disk_read_pending(request):
                i += 1  # its prefix is on its way from disk: those behind it go first meanwhile
                continue
            prefix = self.kv.find_cached_prefix(request) if not request.reads_every_position else PrefixHit([], 0)
            num_new = min(request.num_tokens - prefix.num_tokens, budget)
            if self.kv.allocate_slots(request, num_new, prefix) is None:
                break  # memory is full; FCFS: nobody overtakes the first request that can be admitted
            self.waiting.pop(i)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = prefix.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = prefix.num_tokens
                request.num_disk_prompt_tokens = prefix.num_disk_blocks * self.kv.block_size
                request.num_host_prompt_tokens = prefix.num_host_blocks * self.kv.block_size
            self.running.append(request)
            self._schedule_chunk(request, num_new, out)
            budget -= num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        # Recompute later, ahead of everyone of its priority that arrived after it.
        self._enqueue(request)
        chunks = [c for c in out.chunks if c.request is not request]
        out.chunks[:] = chunks

    # -- after the model ran ---------------------------------------------
    def advance(self, out: SchedulerOutput) -> list[Request]:
        """Record computed tokens; returns the requests whose last position was computed
        this step (they get a sampled token)."""
        sampled = []
        for chunk in out.chunks:
            request = chunk.request
            # drafted positions are computed but not yet part of the sequence: the engine counts the
            # accepted ones once the target has verified them
            request.num_computed_tokens += chunk.num_tokens - chunk.num_draft
            self.kv.free_outside_window(request.request_id, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                sampled.append(request)
        return sampled
