"""What the engine hands back per request per step, and stop-string handling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    """One request's progress after a step. With SamplingParams.output_kind "delta", the fields
    marked (*) are filled on the final output only (empty before): a step then costs O(new
    tokens), not O(output so far)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # on the request's first output and on (*) outputs; empty between
    text: str  # (*) all text released so far (a reference to an immutable string: no copy)
    token_ids: list[int]  # (*) all output tokens
    delta_text: str  # text released by this step
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[str, Any]] | None = None  # (*) one entry per output token, when asked for
    num_cached_prompt_tokens: int = 0
    num_disk_prompt_tokens: int = 0  # of those, read from the KV disk tier
    num_host_prompt_tokens: int = 0  # of those, taken from the KV host tier
    metrics: dict[str, Any] = field(default_factory=dict)  # (*) phase timings
    num_output_tokens: int = 0  # output tokens so far (len(token_ids) when cumulative or final)
    delta_logprobs: list[dict[str, Any]] | None = None  # the logprobs of delta_token_ids, when asked for
    # time.monotonic() when the engine thread handed the step's outputs to the event loop (0: not
    # known, e.g. made in another process); the server measures its delivery delay from it
    produced_at: float = 0.0
    text_offset: int = 0  # characters of text released before delta_text (always filled)
    # finish_reason "error": (reason, message, param) of the failure that ended this request alone (reason:
    # internal_error, grammar_rejected, grammar_unsatisfiable; param: the request field at fault, or None);
    # its consumer raises RequestFailedError for it
    error: tuple[str, str, str | None] | None = None
    # an embedding request's pooled final hidden state (SamplingParams.pooling), on its final output
    embedding: list[float] | None = None


def stop_window(stops: list[str]) -> int:
    """Characters of already-released text a new stop-string match can start in."""
    return max(map(len, stops)) - 1


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string that ends after `search_from`."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, search_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
