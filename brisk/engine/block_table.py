"""Decode rows' block tables kept from step to step (nano-vllm's prepare_block_tables, vLLM v1's
persistent InputBatch): one row of a preallocated int32 array per decoding request, written
when the request gains blocks, so a step's host-side cost is O(rows + new blocks), not
O(rows x context). A step then takes its rows with one numpy gather (C, not Python per block).

It reads the KV manager's live block-id lists (KVCacheManager.live_block_ids): a list that is
the same object as last step only grew at its end; a list cut back (speculative-decoding
truncation) or of a request preempted and admitted again is a new object, and its row is
rewritten.
Entries that the sliding window freed are set to block 0 in the list but may keep their old id
here: neither is ever read (the window excludes those positions). No torch here."""

from __future__ import annotations

from typing import Iterable

import numpy as np


class PersistentBlockTables:
    def __init__(self, max_blocks_per_seq: int = 64, capacity: int = 64):
        self.table = np.zeros((capacity, max(1, max_blocks_per_seq)), dtype=np.int32)
        self.slot_of: dict[str, int] = {}
        self.lists: list[list[int] | None] = [None] * capacity  # the live list each slot mirrors
        self.known = [0] * capacity  # leading entries of the slot's row written from its list
        self.free_slots = list(range(capacity - 1, -1, -1))

    def update(self, key: str, block_ids: list[int]) -> int:
        """The slot of `key`'s row, brought up to date with its live block list."""
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self._take_slot()
            self.slot_of[key] = slot
        elif self.lists[slot] is not block_ids:  # a new list: cut back, or the request admitted again
            self._clear(slot)
        n, known = len(block_ids), self.known[slot]
        if n < known:  # defensive: the manager hands out a new list when it cuts one back
            self.table[slot, n:known] = 0
        elif n > known:
            if n > self.table.shape[1]:
                self._grow(rows=0, cols=max(n, 2 * self.table.shape[1]))
            self.table[slot, known:n] = block_ids[known:n]
        self.lists[slot] = block_ids
        self.known[slot] = n
        return slot

    def gather(self, slots: list[int], num_blocks: int) -> np.ndarray:
        """[len(slots), num_blocks] int32: the rows of a step, padded with block 0."""
        if num_blocks > self.table.shape[1]:
            self._grow(rows=0, cols=num_blocks)
        return self.table[slots, :num_blocks]

    def release_except(self, keys: Iterable[str]) -> None:
        """Free the rows of requests that did not decode this step (finished, preempted, or
        back to prefill); a request that decodes again later is written afresh."""
        keep = set(keys)
        if len(keep) == len(self.slot_of):
            return
        for key in [k for k in self.slot_of if k not in keep]:
            slot = self.slot_of.pop(key)
            self._clear(slot)
            self.free_slots.append(slot)

    def _clear(self, slot: int) -> None:
        self.table[slot, :self.known[slot]] = 0
        self.known[slot] = 0
        self.lists[slot] = None

    def _take_slot(self) -> int:
        if not self.free_slots:
            old = self.table.shape[0]
            self._grow(rows=old, cols=self.table.shape[1])
            self.lists += [None] * old
            self.known += [0] * old
            self.free_slots = list(range(2 * old - 1, old - 1, -1))
        return self.free_slots.pop()

    def _grow(self, rows: int, cols: int) -> None:
        old = self.table
        self.table = np.zeros((old.shape[0] + rows, max(cols, old.shape[1])), dtype=np.int32)
        self.table[:old.shape[0], :old.shape[1]] = old
