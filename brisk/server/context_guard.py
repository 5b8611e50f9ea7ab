"""The context-length guard: count prompt tokens exactly (after the chat template, with
the model's tokenizer) and apply a policy when prompt + max_tokens exceeds the window.

Nothing is ever cut silently: every outcome other than a rejection is described in the
`GuardResult`, which the server reports in the response body, headers and metrics.
Pure Python: the caller passes the encode function.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable


class ContextPolicy(str, enum.Enum):
    REJECT = "reject"
    TRUNCATE_OLDEST = "truncate-oldest"
    CLAMP_MAX_TOKENS = "clamp-max-tokens"


class ContextLengthError(ValueError):
    """prompt + max_tokens does not fit and the policy could not (or may not) fix it."""

    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str,
                 policy: ContextPolicy, detail: str = ""):
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len
        self.param, self.policy = param, policy
        if max_tokens is None:
            asked = f"your prompt has {prompt_tokens} tokens, leaving no room for a completion"
        else:
            asked = (f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                     f"{max_tokens} for the completion)")
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, {asked}. "
            f"{detail}Reduce the prompt or max_tokens (POST /tokenize counts tokens exactly); "
            f"context policy: {policy.value}.")


@dataclass
class GuardResult:
    prompt_ids: list[int]
    max_tokens: int
    policy: ContextPolicy
    outcome: str = "ok"  # "ok" | "truncated" | "clamped"
    messages: list[dict[str, Any]] | None = None  # the messages actually sent (chat)
    truncated_messages: int = 0
    max_tokens_clamped_to: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def report(self) -> dict[str, Any]:
        """The `brisk` object in the response body."""
        out: dict[str, Any] = {"context_policy": self.policy.value, "context_outcome": self.outcome,
                               "prompt_tokens": self.prompt_tokens}
        if self.truncated_messages:
            out["truncated_messages"] = self.truncated_messages
        if self.max_tokens_clamped_to is not None:
            out["max_tokens_clamped_to"] = self.max_tokens_clamped_to
        return out

    def headers(self) -> dict[str, str]:
        out = {"x-brisk-context-outcome": self.outcome, "x-brisk-prompt-tokens": str(self.prompt_tokens)}
        if self.truncated_messages:
            out["x-brisk-truncated-messages"] = str(self.truncated_messages)
        if self.max_tokens_clamped_to is not None:
            out["x-brisk-max-tokens-clamped-to"] = str(self.max_tokens_clamped_to)
        return out


def combined_headers(guards: list[GuardResult]) -> dict[str, str]:
    """The `x-brisk-*` headers of a request: one prompt's as they are; for several prompts
    (multi-prompt completions) each header lists every prompt's value, in prompt order,
    comma-separated ("-" where a prompt has none), so no prompt's outcome goes unreported."""
    if len(guards) == 1:
        return guards[0].headers()
    per_prompt = [g.headers() for g in guards]
    names = [k for k in per_prompt[0]] + [k for h in per_prompt[1:] for k in h if k not in per_prompt[0]]
    names = list(dict.fromkeys(names))
    return {name: ",".join(h.get(name, "-") for h in per_prompt) for name in names}


def _fits(num_prompt: int, max_tokens: int | None, max_model_len: int) -> bool:
    return num_prompt + (max_tokens or 1) <= max_model_len


def guard_prompt(prompt_ids: list[int], max_tokens: int | None, max_model_len: int, policy: ContextPolicy,
                 param: str = "prompt") -> GuardResult:
    """A fixed prompt: accept, clamp max_tokens (policy permitting), or reject.
    `max_tokens=None` means "as many as fit"."""
    n = len(prompt_ids)
    if max_tokens is None:
        if n < max_model_len:
            return GuardResult(prompt_ids, max_model_len - n, policy)
        raise ContextLengthError(n, None, max_model_len, param, policy)
    if _fits(n, max_tokens, max_model_len):
        return GuardResult(prompt_ids, max_tokens, policy)
    if policy is ContextPolicy.CLAMP_MAX_TOKENS and n < max_model_len:
        clamped = max_model_len - n
        return GuardResult(prompt_ids, clamped, policy, "clamped", max_tokens_clamped_to=clamped)
    raise ContextLengthError(n, max_tokens, max_model_len, "max_tokens" if n < max_model_len else param, policy)


def guard_chat(messages: list[dict[str, Any]], encode: Callable[[list[dict[str, Any]]], list[int]],
               max_tokens: int | None, max_model_len: int, policy: ContextPolicy) -> GuardResult:
    """Chat messages: like `guard_prompt`, and with `truncate-oldest`, drop the oldest
    messages other than system messages and the last user message until it fits."""
    ids = encode(messages)
    if policy is not ContextPolicy.TRUNCATE_OLDEST or _fits(len(ids), max_tokens, max_model_len):
        result = guard_prompt(ids, max_tokens, max_model_len, policy, "messages")
        result.messages = messages
        return result
    droppable = _droppable_indices(messages)
    # Binary search the fewest dropped messages that fit (token count falls as messages go).
    lo, hi, best = 1, len(droppable), None
    while lo <= hi:
        k = (lo + hi) // 2
        kept = _drop(messages, droppable[:k])
        kept_ids = encode(kept)
        if _fits(len(kept_ids), max_tokens, max_model_len):
            best, hi = (k, kept, kept_ids), k - 1
        else:
            lo = k + 1
    if best is None:
        minimal = encode(_drop(messages, droppable))
        raise ContextLengthError(len(minimal), max_tokens, max_model_len, "messages", policy,
                                 detail=f"Even keeping only the system message(s) and the last user message, "
                                        f"the prompt has {len(minimal)} tokens. ")
    k, kept, kept_ids = best
    result = guard_prompt(kept_ids, max_tokens, max_model_len, policy, "messages")
    result.outcome, result.messages, result.truncated_messages = "truncated", kept, k
    return result


def _droppable_indices(messages: list[dict[str, Any]]) -> list[int]:
    """Oldest first: every message except system/developer ones and the last user message."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
    return [i for i, m in enumerate(messages[:last_user]) if m.get("role") not in ("system", "developer")]


def _drop(messages: list[dict[str, Any]], indices: list[int]) -> list[dict[str, Any]]:
    gone = set(indices)
    return [m for i, m in enumerate(messages) if i not in gone]
