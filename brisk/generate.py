"""Single-sequence generation over the contiguous cache (`brisk generate`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from brisk.errors import BriskError
from brisk.loading.loader import LoadedModel
from brisk.models.simple_cache import SingleSequenceCache


@dataclass
class GenerationTimings:
    """Monotonic-clock phase durations of one generation, in milliseconds."""

    prefill_ms: float = 0.0  # prompt forward up to the first sampled token (= TTFT here)
    decode_ms: float = 0.0  # all later tokens
    token_times: list[float] = field(default_factory=list, repr=False)

    def to_dict(self, completion_tokens: int) -> dict:
        decode_tokens = max(completion_tokens - 1, 0)
        return {
            "prefill_ms": round(self.prefill_ms, 2),
            "ttft_ms": round(self.prefill_ms, 2),
            "decode_ms": round(self.decode_ms, 2),
            "decode_tokens_per_s": round(decode_tokens / (self.decode_ms / 1e3), 2) if self.decode_ms else None,
        }


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate_ids(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, ignore_eos: bool = False,
                 timings: GenerationTimings | None = None) -> Iterator[int]:
    """Yield generated token ids one by one (stops at EOS unless `ignore_eos`)."""
    if not prompt_ids:
        raise BriskError("the prompt is empty after tokenization; give a non-empty prompt")
    if max_tokens <= 0:
        raise BriskError(f"--max-tokens {max_tokens} must be at least 1")
    if temperature < 0:
        raise BriskError(f"--temperature {temperature} must be >= 0 (0 means greedy)")
    total = len(prompt_ids) + max_tokens
    if total > loaded.max_model_len:
        raise BriskError(
            f"prompt ({len(prompt_ids)} tokens) + max tokens ({max_tokens}) = {total} exceeds the model's "
            f"context of {loaded.max_model_len} tokens; shorten the prompt or lower --max-tokens"
        )
    timings = timings or GenerationTimings()
    device = loaded.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    cache = SingleSequenceCache(loaded.config, total, loaded.dtype, device)
    eos = set(loaded.tokenizer.eos_token_ids)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    start = time.perf_counter()
    with torch.inference_mode():
        for step in range(max_tokens):
            cache.begin(len(ids))
            positions = torch.arange(cache.num_cached, cache.num_cached + len(ids), device=device)
            hidden = loaded.model(ids, positions, cache)
            cache.commit()
            token = _sample(loaded.model.compute_logits(hidden[-1:])[0], temperature, generator)
            now = time.perf_counter()
            timings.token_times.append(now)
            if step == 0:
                timings.prefill_ms = (now - start) * 1e3
            else:
                timings.decode_ms = (now - timings.token_times[0]) * 1e3
            yield token
            if token in eos and not ignore_eos:
                return
            ids = torch.tensor([token], dtype=torch.long, device=device)
