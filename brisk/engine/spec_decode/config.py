"""`--speculative-config` (vLLM's shape), validated at start (no torch here).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"model": "PATH", "num_speculative_tokens": 4}          (a draft model: method "draft_model")

Only the methods brisk implements are accepted; anything else is one clear error at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from brisk.errors import BriskError

MAX_SPECULATIVE_TOKENS = 16
METHODS = ("ngram", "draft_model")
DEFAULT_MIN_ACCEPTANCE = {"ngram": 0.1, "draft_model": 0.3}
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size", "min_acceptance_rate"}


class SpeculativeConfigError(BriskError):
    """A --speculative-config the server cannot run; the message names the key and the fix."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    # The load rule: no request drafts while more than this many requests are running (each step's
    # forward is then wide enough that verifying k extra tokens per row costs more than it saves).
    disable_by_batch_size: int = 4
    # The acceptance rule: a request whose recent drafts are accepted at less than this rate stops
    # drafting for a while (see spec_decode.policy). Defaults per method (parse): n-gram drafts cost
    # little (a 5-row verification step costs ~1.3 one-row steps here), so 0.1; a draft model's
    # k forwards cost more, so 0.3.
    min_acceptance_rate: float = 0.1

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> "SpeculativeConfig":
        if isinstance(text, str):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(f"--speculative-config is not valid JSON ({e.msg} at character {e.pos}); "
                                             "example: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
        else:
            raw = text
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object, e.g. "
                                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                                         f"known: {', '.join(sorted(_KEYS))}")
        method = raw.get("method") or ("draft_model" if raw.get("model") else None)
        if method is None:
            raise SpeculativeConfigError("--speculative-config needs \"method\": \"ngram\" or a draft \"model\"")
        if method not in METHODS:
            raise SpeculativeConfigError(f"--speculative-config: unknown method {method!r}; brisk implements "
                                         f"{', '.join(METHODS)} (give \"model\" for a draft model)")
        if method == "draft_model" and not raw.get("model"):
            raise SpeculativeConfigError("--speculative-config: method draft_model needs \"model\": the draft's path")
        if method == "ngram" and raw.get("model"):
            raise SpeculativeConfigError("--speculative-config: method ngram takes no \"model\"; drop it, or drop "
                                         "\"method\" to speculate with that draft model")
        k = _int(raw, "num_speculative_tokens", 4 if method == "ngram" else None)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"--speculative-config: num_speculative_tokens must be in "
                                         f"[1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        lo = raw.get("prompt_lookup_min")
        hi = raw.get("prompt_lookup_max")
        if lo is None:  # defaults 2..4; a single bound given keeps the pair ordered
            lo = min(2, hi) if isinstance(hi, int) else 2
        if hi is None:
            hi = max(4, lo) if isinstance(lo, int) else 4
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpeculativeConfigError(f"--speculative-config: {name} must be an integer >= 1, got {value!r}")
        if lo > hi:
            raise SpeculativeConfigError(f"--speculative-config: prompt_lookup_min ({lo}) exceeds "
                                         f"prompt_lookup_max ({hi})")
        batch = _int(raw, "disable_by_batch_size", cls.disable_by_batch_size)
        if batch < 1:
            raise SpeculativeConfigError(f"--speculative-config: disable_by_batch_size must be >= 1, got {batch}")
        rate = raw.get("min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE[method])
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0.0 <= rate < 1.0:
            raise SpeculativeConfigError(f"--speculative-config: min_acceptance_rate must be in [0, 1), got {rate!r}")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                   model=raw.get("model"), disable_by_batch_size=batch, min_acceptance_rate=float(rate))


def _int(raw: dict[str, Any], key: str, default: int | None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise SpeculativeConfigError(f"--speculative-config needs {key!r}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpeculativeConfigError(f"--speculative-config: {key} must be an integer, got {value!r}")
    return value
