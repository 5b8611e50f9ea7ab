"""A request's state as it moves through the engine, with its lifecycle timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from brisk.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its own work failed (Request.error says why); the others went on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass
class RequestTimes:
    """Monotonic seconds (time.monotonic). One set of stamps; every report derives from it."""

    arrival_ts: float = field(default_factory=time.monotonic)
    first_scheduled_ts: float | None = None
    first_token_ts: float | None = None
    token_ts: list[float] = field(default_factory=list)
    finished_ts: float | None = None

    def phases_ms(self) -> dict[str, float | None]:
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1e3, 3)

        return {
            "queue_ms": ms(self.arrival_ts, self.first_scheduled_ts),
            "prefill_ms": ms(self.first_scheduled_ts, self.first_token_ts),
            "ttft_ms": ms(self.arrival_ts, self.first_token_ts),
            "decode_ms": ms(self.first_token_ts, self.finished_ts),
            "e2e_ms": ms(self.arrival_ts, self.finished_ts),
        }

    def itl_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.token_ts, self.token_ts[1:])]


@dataclass(eq=False)
class Request:
    request_id: str
    # The prompt, then each output token appended as it is sampled: the request's one token list.
    # Read it, never copy it per step; `prompt_token_ids` and `output_token_ids` are slices of it.
    all_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first; FCFS among equals
    cache_salt: str | None = None
    prompt: str | None = None
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_disk_prompt_tokens: int = 0  # of those, the ones read from the KV disk tier (--kv-cache-dir)
    num_host_prompt_tokens: int = 0  # of those, the ones taken from the KV host tier (--kv-cache-host-bytes)
    status: RequestStatus = RequestStatus.WAITING
    times: RequestTimes = field(default_factory=RequestTimes)
    num_preemptions: int = 0
    arrival_seq: int = 0  # tie-breaker for FCFS order, set by the scheduler
    # Filled by the engine's output processing.
    output_text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    detokenizer: Any = None
    stop_reason: str | int | None = None
    error: tuple[str, str, str | None] | None = None  # (reason, message, param) of a request ended with FINISHED_ERROR
    grammar: Any = None  # this sequence's grammar matcher (structured outputs), or None
    tool_calls: Any = None  # this sequence's tool-call reader (SamplingParams.tool_plan), or None
    # Speculative decoding: this step's drafted tokens (verified by the target, never part of the
    # sequence until accepted) and the request's drafting state (spec_decode.policy.SpecState).
    spec_token_ids: list[int] = field(default_factory=list)
    spec: Any = None
    # An embedding request (params.pooling): its pooled hidden state so far (the model runner's tensor: a running
    # sum for "mean", the first row for "cls"), and the final vector once its prompt is computed.
    pooled: Any = None
    embedding: list[float] | None = None
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.all_token_ids)  # owned: the caller's prompt list is never appended to
        self.num_prompt_tokens = len(self.all_token_ids)

    def append_output(self, token: int) -> None:
        self.all_token_ids.append(token)

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy (O(prompt)): for a request's first or final output, not for every step."""
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """A read-only copy of the output so far (O(output)); append with `append_output`."""
        return tuple(self.all_token_ids[self.num_prompt_tokens:])

    def output_tokens_from(self, start: int) -> list[int]:
        """Output tokens start.. (O(returned)): a step's new tokens."""
        return self.all_token_ids[self.num_prompt_tokens + start:]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def reads_every_position(self) -> bool:
        """An embedding request that pools over its positions (mean, cls) needs each one's hidden state: prefix-cache
        hits would skip computing them."""
        return self.params.pooling in ("mean", "cls")

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
