"""Per-request sampling parameters, validated on construction (no torch here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from brisk.errors import ParamError

MAX_LOGPROBS = 20
OUTPUT_KINDS = ("cumulative", "delta")
POOLINGS = (None, "last", "mean", "cls")
# Below this temperature, sampling is greedy: dividing logits by ~0 overflows to inf/NaN.
GREEDY_TEMPERATURE = 1e-5
# torch's generators take seeds in [0, 2**64): every seed is reduced modulo 2**64 once, here, and
# every sum on a seed wraps the same way. torch reads a negative seed as its two's complement, so
# a seed it already took draws exactly as before.
SEED_MODULUS = 2**64


class SamplingParamsError(ParamError):
    """A sampling parameter outside its allowed range."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token, 0..20
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    # a brisk.structured.compiler.CompiledGrammar; each sequence gets its own matcher from it
    grammar: Any = None
    # a brisk.structured.tools.ToolPlan with parallel calls: the engine reads the reply's calls as it
    # generates and ends it (finish_reason "stop", stop_reason "repeated_tool_call") at a call that
    # repeats the one before it exactly, which small models do until max_tokens
    tool_plan: Any = None
    # What each step's RequestOutput carries (vLLM's RequestOutputKind): "cumulative" (token_ids,
    # logprobs and metrics of the whole output so far, on every step: O(L) per step), or "delta"
    # (only what is new, O(1) per step; token_ids and metrics come once, on the final output).
    output_kind: str = "cumulative"
    # Whether this request may be sped up by speculative decoding when the server runs it (the
    # output distribution is the same either way; false opts one request out).
    speculative: bool = True
    # An embedding request (prefill only): the prompt's final hidden states pooled ("last": the last token's,
    # "mean": their mean, "cls": the first token's) come back as RequestOutput.embedding; nothing is generated.
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.seed, int) and not isinstance(self.seed, bool):
            self.seed %= SEED_MODULUS
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100] (0 = greedy)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be an integer >= 0 (0 = off)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
             "must be an integer"),
            ("logit_bias", self.logit_bias is None or all(
                isinstance(t, int) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
             "must map token ids to biases in [-100, 100]"),
            ("output_kind", self.output_kind in OUTPUT_KINDS, f"must be one of {', '.join(OUTPUT_KINDS)}"),
            ("speculative", isinstance(self.speculative, bool), "must be true or false"),
            ("pooling", self.pooling in POOLINGS, f"must be one of {', '.join(map(str, POOLINGS))}"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise SamplingParamsError(name, f"{message}, got {getattr(self, name)!r}")

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice `index` of an `n > 1` request: with a seed, choice i draws from
        seed + i (wrapped), so the choices differ and each is reproducible."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + index) % SEED_MODULUS)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
