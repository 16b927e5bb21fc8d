"""The draft server's KV cache: a RaggedKVCache that gives memory back after a burst.

The cache grows by doubling to hold the live sequences and never shrank: after
two targets sent 256 sequences of 511 tokens each, the draft server kept
1.3 GB with no sequence live. `shrink()` reallocates the buffers to what the
live slots hold plus room to grow; the engine calls it between rounds once
the live sequences use a small part of the cache (DraftEngine.shrink_cache).
"""

from __future__ import annotations

import torch

from starjar.model.kv_cache import RaggedKVCache

# A new cache's size (RaggedKVCache's defaults): a shrink never goes below it.
MIN_SLOTS = 4
MIN_LENGTH = 256


class DraftKVCache(RaggedKVCache):
    def __init__(self, device: torch.device | str, dtype: torch.dtype, max_cells: int | None = None):
        super().__init__(device, dtype, initial_slots=MIN_SLOTS, initial_capacity=MIN_LENGTH, max_cells=max_cells)

    @property
    def capacity(self) -> tuple[int, int]:
        """(slots, positions per slot) the buffers have room for."""
        return self._slot_cap, self._len_cap

    def shrink(self, slots: int, length: int) -> bool:
        """Reallocate to room for (slots, length), never below what the live slots hold (their KV is copied).
        Call between passes. Whether the buffers shrank."""
        live, used = self.num_slots, max(self.lengths, default=0)
        slots = min(self._slot_cap, max(slots, live, 1))
        length = min(self._len_cap, max(length, used, 1))
        if (slots, length) == (self._slot_cap, self._len_cap):
            return False
        self._views = None  # they hold the old buffers
        for bufs in (self._keys, self._values):
            for i, old in enumerate(bufs):
                new = torch.zeros((slots, old.shape[1], length, old.shape[3]), dtype=old.dtype, device=old.device)
                new[:live, :, :used] = old[:live, :, :used]
                bufs[i] = new  # the old buffer goes now: at most one layer's old and new are held at once
        self._slot_cap, self._len_cap = slots, length
        return True
