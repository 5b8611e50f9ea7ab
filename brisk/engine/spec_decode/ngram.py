"""N-gram (prompt-lookup) proposer, pure Python: find the most recent earlier occurrence of the
sequence's last n tokens (longest n in [min, max]) in its own prompt + output and propose the
tokens that followed it. Input-grounded replies (rewrites, code edits, quotes) repeat long runs of
the prompt, so the proposals are often right and the target accepts several tokens per forward.

Each request keeps an incremental index (its own token list and a map from each `min`-gram to the
positions where it ended), so a step costs O(new tokens + candidates checked), not O(context)."""

from __future__ import annotations

from collections import defaultdict

MAX_CANDIDATES = 8  # most recent occurrences of the min-gram extended towards max per step


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._indexed = 0  # grams ending before this position are in `ends`

    def extend(self, sequence: list[int]) -> None:
        """Bring the index's copy of the sequence (prompt + output) up to date: appends only what is new."""
        self.tokens.extend(sequence[len(self.tokens):])

    def propose(self, max_tokens: int) -> list[int]:
        tokens, n = self.tokens, self.min_n
        last = len(tokens) - 1
        if max_tokens <= 0 or last < n:
            return []
        # index every min-gram ending before the last token (the current one must not match itself)
        for end in range(max(self._indexed, n - 1), last):
            self.ends[tuple(tokens[end - n + 1:end + 1])].append(end)
        self._indexed = max(self._indexed, last)
        candidates = self.ends.get(tuple(tokens[last - n + 1:]))
        if not candidates:
            return []
        best_end, best_len = -1, 0
        for end in reversed(candidates[-MAX_CANDIDATES:]):
            length = n
            while length < self.max_n and end - length >= 0 and tokens[end - length] == tokens[last - length]:
                length += 1
            if length > best_len:
                best_end, best_len = end, length
                if length == self.max_n:
                    break
        return tokens[best_end + 1:best_end + 1 + max_tokens]
