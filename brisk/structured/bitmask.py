"""Applies grammar masks to the rows of a batch's logits that have a grammar (others untouched)."""

from __future__ import annotations

from typing import Any

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(matchers: list[Any], vocab_size: int, executor: Any = None) -> torch.Tensor:
    """[len(matchers), words] int32, bit j of word w set = token 32*w+j allowed. With an executor,
    the rows are computed in parallel (llguidance drops the GIL)."""
    words = _words(vocab_size)
    bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
    if executor is not None and len(matchers) > 1:
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                         words * 4, len(matchers))
    else:
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
    return bitmask


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def allowed_tokens(matcher: Any, vocab_size: int) -> torch.Tensor:
    """Bool [vocab_size] for one matcher (tests and warm-up)."""
    return unpack(fill_bitmask([matcher], vocab_size), vocab_size)[0]


class GrammarMasker:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = list(eos_token_ids)
        self._executor: Any = None

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """In place: tokens a row's grammar forbids get -inf. A matcher in an error state (it never
        should be) allows nothing; such a row may end with EOS instead of producing garbage."""
        if self._executor is None and len(matchers) > 1:
            import llguidance

            self._executor = llguidance.LLExecutor()
        vocab = logits.shape[-1]
        allowed = unpack(fill_bitmask(matchers, vocab, self._executor), vocab)
        stuck = ~allowed.any(dim=-1)
        if bool(stuck.any()) and self.eos_token_ids:
            allowed[stuck, self.eos_token_ids[0]] = True
        allowed = allowed.to(logits.device, non_blocking=True)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
